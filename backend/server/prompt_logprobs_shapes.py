"""Prompt logprobs in the response shapes clients read: vLLM's `prompt_logprobs` (token id -> logprob, rank and
decoded token, the first entry null) and the legacy completions API's echo with logprobs (the prompt's tokens
before the generated ones, its first token's logprob null), as lm-evaluation-harness reads them."""

from backend.outputs import Logprob

# JSON has no -inf: a token the model rules out entirely (logit -inf) gets OpenAI's floor instead
LOGPROB_FLOOR = -9999.0


def json_logprob(value: float) -> float:
    return max(value, LOGPROB_FLOOR)


def prompt_logprobs_json(entries: list[dict[int, Logprob] | None] | None, token_ids: list[int], top: int
                         ) -> list[dict | None] | None:
    """vLLM's prompt_logprobs field: per prompt token None (the first) or {token id: {logprob, rank,
    decoded_token}} for the token and the `top` most likely."""
    if entries is None:
        return None
    return [None if e is None else {str(t): {"logprob": json_logprob(lp.logprob), "rank": lp.rank,
                                             "decoded_token": lp.decoded_token}
                                    for t, lp in e.items() if t == token or lp.rank <= top}
            for token, e in zip(token_ids, entries)]


def token_text(lp: Logprob) -> str:
    return lp.decoded_token or ""


def completion_logprobs(entries: list[dict[int, Logprob] | None], token_ids: list[int], top: int, offset: int,
                        tokenizer=None) -> dict:
    """The legacy completions API's logprobs of these tokens: each token's text, logprob and the `top` most likely
    tokens besides it (the chosen one always included, so up to top + 1), with each token's character offset
    from `offset`. An entry of None (a prompt's first token) has a null logprob and top_logprobs, its text
    decoded with `tokenizer`."""
    tokens, token_logprobs, tops, offsets = [], [], [], []
    for token, entry in zip(token_ids, entries):
        if entry is None:
            text, value, best = tokenizer.decode([token]) if tokenizer is not None else "", None, None
        else:
            chosen = entry[token]
            text, value = token_text(chosen), json_logprob(chosen.logprob)
            best = None
            if top:  # keyed by text: where two tokens share one, the likelier keeps it
                best = {}
                for _, lp in sorted(entry.items(), key=lambda item: item[1].rank)[:top]:
                    best.setdefault(token_text(lp), json_logprob(lp.logprob))
                best.setdefault(text, value)
        tokens.append(text)
        token_logprobs.append(value)
        tops.append(best)
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops, "text_offset": offsets}


def joined(first: dict, second: dict) -> dict:
    """Two completion logprobs objects as one (the prompt's, then the generated tokens')."""
    return {key: first[key] + second[key] for key in first}
