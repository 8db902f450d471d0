"""POST /v1/completions: the legacy text completions API, echo and prompt logprobs included (what evaluation
harnesses such as lm-evaluation-harness send for loglikelihood: echo, logprobs and max_tokens 0 or 1)."""

from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import Request

from backend.server.client_id import client_id
from backend.server.errors import APIError
from backend.server.prompt_logprobs_shapes import completion_logprobs, joined, prompt_logprobs_json
from backend.server.prompts import admit, budget, check_guided, clamped_headers, completion_prompts, off_loop
from backend.server.protocol import CompletionRequest, completion_choice, new_id, now, sampling_params, usage
from backend.server.state import ServerState
from backend.server.streams import answer, collect, event, merge, sse, until_disconnect


@dataclass
class Echo:
    """What a choice shows before its completion: the prompt's text and, with logprobs, the prompt tokens'."""

    texts: list[str]  # per prompt
    generate: bool  # False for max_tokens 0: the prompt alone, its one generated token dropped

    def logprobs(self, req: CompletionRequest, prompt: list[int], entries, tokenizer) -> dict | None:
        if req.logprobs is None or entries is None:
            return None
        return completion_logprobs(entries, prompt, req.logprobs, 0, tokenizer)


async def create_completion(state: ServerState, req: CompletionRequest, request: Request):
    engine = state.ready_engine()
    if req.suffix:
        raise APIError(400, "suffix is not supported", param="suffix")
    if req.best_of is not None and req.best_of != req.n:
        raise APIError(400, "best_of must equal n (candidates are not ranked)", param="best_of")
    if req.max_tokens == 0 and not req.echo:
        raise APIError(400, "max_tokens must be at least 1, or 0 with echo: true (the prompt's logprobs alone)",
                       param="max_tokens")
    several = isinstance(req.prompt, list) and bool(req.prompt) and not isinstance(req.prompt[0], int)
    count, limit = (len(req.prompt) if several else 1), engine.engine.config.max_prompts
    if count * req.n > limit:  # before any prompt is tokenized
        raise APIError(400, f"this request asks for {count * req.n} sequences ({count} prompts, n={req.n}); this "
                       f"server takes at most {limit} a request (serve --max-prompts): send them in several "
                       "requests", param="prompt")
    named = await completion_prompts(req.prompt, engine.engine)
    # the legacy API's default is 16; max_tokens 0 (echo) computes the prompt and drops the one token generated
    requested = 16 if req.max_tokens is None else 1 if req.max_tokens == 0 else req.max_tokens
    # echo with logprobs: the prompt tokens' logprobs too, with as many top ones (vLLM's rule)
    asked = [v for v in (req.prompt_logprobs, req.logprobs if req.echo else None) if v is not None]
    clamp = state.policy.max_tokens_past_context == "clamp"
    allowed = [budget(engine.engine, len(p), requested, "max_tokens", where, clamp) for p, where in named]
    admitted = [await admit(engine.engine, p, sampling_params(
        req, limit, req.logprobs, prompt_logprobs=max(asked) if asked else None), where)
        for (p, where), limit in zip(named, allowed)]
    headers = clamped_headers(requested, allowed)
    prompts = [a.token_ids for a in admitted]
    echo = Echo(await _prompt_texts(req.prompt, prompts, engine.engine.tokenizer), req.max_tokens != 0) \
        if req.echo else None
    await check_guided(engine.engine, admitted[0].params)
    rid = new_id("cmpl")
    # one request's prompts take their turns at admission together, so they cannot crowd out later requests
    client = client_id(request, req)
    gens = [engine.generate(f"{rid}-{i}", a, group=rid, client=client) for i, a in enumerate(admitted)]
    tokenizer = engine.engine.tokenizer
    if req.stream:
        return answer(sse(_stream(state, rid, req, gens, prompts, echo, tokenizer)), headers)
    finals = await until_disconnect(request, collect(gens, prompts, req.n))
    choices, completion_tokens = [], 0
    for i, out in enumerate(finals):
        head_lp = echo.logprobs(req, prompts[i], out.prompt_logprobs, tokenizer) if echo is not None else None
        for c in out.outputs:
            text, ids, entries, reason = c.text, c.token_ids, c.logprobs, c.finish_reason
            if echo is not None and not echo.generate:
                text, ids, entries, reason = "", [], ([] if entries is not None else None), "length"
            head = echo.texts[i] if echo is not None else ""
            choice = completion_choice(i * req.n + c.index, head + text, ids, entries, req.logprobs, reason, len(head))
            if head_lp:
                choice["logprobs"] = joined(head_lp, choice["logprobs"])
            if req.prompt_logprobs is not None:
                choice["prompt_logprobs"] = prompt_logprobs_json(out.prompt_logprobs, prompts[i], req.prompt_logprobs)
            choices.append(choice)
            completion_tokens += len(ids)
    return answer({"id": rid, "object": "text_completion", "created": now(), "model": state.served_model_name,
                   "choices": choices, "usage": usage(sum(len(p) for p in prompts), completion_tokens,
                                                      sum(out.num_cached_tokens for out in finals))}, headers)


async def _prompt_texts(prompt, ids: list[list[int]], tokenizer) -> list[str]:
    """Each prompt as echo shows it: the text sent, or token ids decoded."""
    if isinstance(prompt, str):
        return [prompt]
    if prompt and isinstance(prompt[0], str):
        return list(prompt)
    return [await off_loop(tokenizer.decode, p) for p in ids]


def _stream(state: ServerState, rid: str, req: CompletionRequest, gens: list, prompts: list[list[int]],
            echo: Echo | None, tokenizer) -> AsyncIterator[str]:
    created, include_usage = now(), bool(req.stream_options and req.stream_options.include_usage)

    def chunk(choices: list[dict], usage_value=None) -> str:
        body = {"id": rid, "object": "text_completion", "created": created, "model": state.served_model_name,
                "choices": choices}
        if include_usage:
            body["usage"] = usage_value
        return event(body)

    async def events():
        offsets = [[0] * req.n for _ in prompts]  # characters each choice has sent (logprobs' text_offset)
        echoed = [False] * len(prompts)
        prompt_tokens = completion_tokens = 0
        cached = [0] * len(prompts)
        async for i, delta in merge(gens):
            cached[i] = delta.num_cached_tokens
            # The prompt goes first, once its logprobs (when asked for) are computed.
            asked = (echo is not None and req.logprobs is not None) or req.prompt_logprobs is not None
            wait = asked and delta.prompt_logprobs is None
            if not echoed[i] and not (wait and not delta.finished):
                echoed[i] = True
                head_lp = echo.logprobs(req, prompts[i], delta.prompt_logprobs, tokenizer) if echo else None
                for j in range(req.n):
                    choice = completion_choice(i * req.n + j, echo.texts[i] if echo else "", [], None, None, None)
                    if echo is not None:
                        choice["logprobs"] = head_lp
                        offsets[i][j] = len(echo.texts[i])
                    if req.prompt_logprobs is not None:
                        choice["prompt_logprobs"] = prompt_logprobs_json(delta.prompt_logprobs, prompts[i],
                                                                         req.prompt_logprobs)
                    if echo is not None or req.prompt_logprobs is not None:
                        yield chunk([choice])
            for d in delta.outputs:
                if echo is not None and not echo.generate:
                    if d.finished:
                        yield chunk([completion_choice(i * req.n + d.index, "", [], [] if d.logprobs else None,
                                                       req.logprobs, "length", offsets[i][d.index])])
                    continue
                completion_tokens += len(d.token_ids)
                if d.text or d.finished or (req.logprobs is not None and d.token_ids):
                    piece = completion_choice(i * req.n + d.index, d.text, d.token_ids, d.logprobs, req.logprobs,
                                              d.finish_reason, offsets[i][d.index])
                    yield chunk([piece])
                    # offsets count the tokens' texts, as the whole answer's do
                    if piece["logprobs"] is not None:
                        offsets[i][d.index] += sum(len(t) for t in piece["logprobs"]["tokens"])
            if delta.finished:
                prompt_tokens += len(prompts[i])
        if include_usage:
            yield chunk([], usage(prompt_tokens, completion_tokens, sum(cached)))

    return events()
