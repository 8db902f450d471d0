"""A request checked whole before anything of it is queued: its prompt, and its settings against this
engine's limits. What fails here is the caller's to fix (InvalidParameter / ValueError, a 400)."""

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from backend.detokenizer import IncrementalDetokenizer
from backend.engine.sequence import Sequence
from backend.sampling_params import InvalidParameter, SamplingParams

# Tokens one embeddings request may hold, summed over its inputs (max_embedding_tokens; at least one input of the
# whole context): a few seconds to a minute of work on the CPU; OpenAI's API takes 300,000 per request.
MAX_EMBEDDING_TOKENS = 65536


def too_long(limit: int, prompt: str, param: str) -> InvalidParameter:
    """The one answer to a prompt the context cannot hold, measured in tokens or (before tokenizing) characters:
    the engine's, and the server's before it tokenizes (server/prompts.py)."""
    return InvalidParameter(param, f"This model's maximum context length is {limit} tokens, but the prompt has "
                            f"{prompt}; shorten it.", code="context_length_exceeded")


@dataclass(frozen=True)
class AdmittedRequest:
    """A request LLMEngine.validate_request passed: its prompt's token ids (and its text, when it came as text)
    and its settings. add_request queues it as it is, without checking it again."""
    token_ids: list[int]
    params: SamplingParams
    text: str | None = None
    client: str | None = None  # who sent it (server/client_id.py): admission takes clients in turns


@dataclass(frozen=True)
class AdmittedEmbedding:
    """An embeddings request's inputs Limits.check_embedding passed, queued as they are."""
    inputs: list[list[int]]


@dataclass
class Limits:
    vocab_size: int
    max_model_len: int
    max_n: int  # sequences one request may ask for (n)
    max_num_seqs: int  # sequences that run at once: n beyond it could never be scheduled together
    # No token is longer than the vocabulary's longest entry, so a text of more characters than this cannot
    # fit in the context (None: no tokenizer); refused before tokenizing it.
    max_prompt_chars: int | None = None
    max_embedding_tokens: int = MAX_EMBEDDING_TOKENS  # one embeddings request's tokens, all its inputs together

    @classmethod
    def of(cls, tokenizer, vocab_size: int, max_model_len: int, max_n: int, max_num_seqs: int,
           max_embedding_tokens: int | None = None) -> "Limits":
        longest = max((len(t) for t in tokenizer.get_vocab()), default=1) if tokenizer is not None else None
        return cls(vocab_size, max_model_len, max_n, max_num_seqs,
                   max_model_len * max(longest, 1) if longest is not None else None,
                   max_embedding_tokens or max(MAX_EMBEDDING_TOKENS, max_model_len))

    def check(self, params: SamplingParams) -> None:
        if params.n > min(self.max_n, self.max_num_seqs):
            which = "max_n" if self.max_n <= self.max_num_seqs else "max_num_seqs"
            raise InvalidParameter("n", f"n must be at most {min(self.max_n, self.max_num_seqs)} on this server "
                                   f"({which}), got {params.n}")
        bias = params.logit_bias or {}
        outside = [t for t in bias if t >= self.vocab_size]
        if outside:
            raise InvalidParameter("logit_bias", f"logit_bias: token id {outside[0]} is not in the vocabulary "
                                   f"(ids 0 to {self.vocab_size - 1})")
        outside = [t for t in params.allowed_token_ids or [] if t >= self.vocab_size]
        if outside:
            raise InvalidParameter("allowed_token_ids", f"allowed_token_ids: token id {outside[0]} is not in the "
                                   f"vocabulary (ids 0 to {self.vocab_size - 1})")
        if params.top_k > self.vocab_size:
            raise InvalidParameter("top_k", f"top_k must be at most the vocabulary size ({self.vocab_size}), or 0 / "
                                   f"-1 for no limit; got {params.top_k}")

    def token_ids(self, ids: list[int], param: str) -> list[int]:
        """The one check of a prompt's (or an input's) token ids: some, and each in the vocabulary."""
        if not ids:
            raise InvalidParameter(param, f"{param} is empty; give at least one token")
        vocab = self.vocab_size
        if any(not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab for t in ids):
            raise InvalidParameter(param, f"{param}: token ids must be integers in [0, {vocab})")
        return ids

    def check_embedding(self, inputs: list[list[int]]) -> AdmittedEmbedding:
        """An embeddings request's inputs (token ids): each one non-empty, in the vocabulary and within the
        context, and all of them together within max_embedding_tokens."""
        if not inputs:
            raise InvalidParameter("input", "input is empty; give at least one text or list of token ids")
        for i, ids in enumerate(inputs):
            where = f"input[{i}]" if len(inputs) > 1 else "input"
            self.token_ids(ids, where)
            if len(ids) > self.max_model_len:
                raise InvalidParameter(where, f"{where} has {len(ids)} tokens; this model embeds at most "
                                       f"{self.max_model_len} (max_model_len)", code="context_length_exceeded")
        total = sum(len(ids) for ids in inputs)
        if total > self.max_embedding_tokens:
            raise InvalidParameter("input", f"input holds {total} tokens in {len(inputs)} inputs; this server embeds at "
                                   f"most {self.max_embedding_tokens} tokens per request (max_embedding_tokens): "
                                   "send the inputs in several requests", code="embedding_tokens_exceeded")
        return AdmittedEmbedding(inputs)

    def prompt_ids(self, prompt: str | list[int], tokenizer, model_name: str,
                   param: str = "prompt") -> tuple[list[int], str | None]:
        """The prompt's token ids (and its text when given as text), refused when they cannot run."""
        if isinstance(prompt, str):
            if tokenizer is None:
                raise ValueError(f"model {model_name!r} has no tokenizer: give prompts as token ids")
            if self.max_prompt_chars is not None and len(prompt) > self.max_prompt_chars:
                raise too_long(self.max_model_len, f"{len(prompt)} characters, more than that many tokens can hold",
                               param)
            token_ids, text = tokenizer(prompt).input_ids, prompt
        else:
            token_ids, text = list(prompt), None
        self.token_ids(token_ids, param)
        if len(token_ids) >= self.max_model_len:
            raise too_long(self.max_model_len, f"{len(token_ids)} tokens", param)
        return token_ids, text


def admit(limits: Limits, prompt: str | list[int] | list[dict], params: SamplingParams, tokenizer, model_name: str,
          param: str = "prompt") -> AdmittedRequest:
    """The prompt (text, token ids, or chat messages through the model's chat template) and its settings checked
    against the engine's limits (LLMEngine.validate_request)."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], dict):
        if tokenizer is None:
            raise ValueError(f"model {model_name!r} has no tokenizer: give prompts as token ids")
        ids = chat_prompt_ids(tokenizer, prompt, model_name)
        token_ids, _ = limits.prompt_ids(ids, tokenizer, model_name, param)
        text = tokenizer.decode(token_ids)
    else:
        token_ids, text = limits.prompt_ids(prompt, tokenizer, model_name, param)
    limits.check(params)
    return AdmittedRequest(token_ids, params, text)


def request_sequences(request_id: str, request: AdmittedRequest, seq_ids: Iterator[int], matchers: list,
                      group: str | None, tokenizer, device: torch.device, share_prompt: bool) -> list[Sequence]:
    """The request's n sequences, as add_request queues them (matchers: each one's grammar, or None).
    share_prompt: the prompt is prefilled once, for the first sequence, and the others fork from it
    (Scheduler.start_forks); else each prefills its own."""
    token_ids, params = request.token_ids, request.params
    ids = [next(seq_ids) for _ in range(params.n)]

    def sequence(i: int, **first: object) -> Sequence:
        detokenizer = (IncrementalDetokenizer(tokenizer, token_ids, params.skip_special_tokens)
                       if tokenizer is not None else None)
        generator = (torch.Generator(device=device).manual_seed(params.sequence_seed(i))
                     if params.seed is not None else None)
        return Sequence(seq_id=ids[i], request_id=request_id, index=i, token_ids=list(token_ids),
                        num_prompt_tokens=len(token_ids), params=params, matcher=matchers[i], group=group, client=request.client,
                        detokenizer=detokenizer, generator=generator, **first)

    siblings = [sequence(i) for i in range(1, params.n)]
    prompt_logprobs = None if params.prompt_logprobs is None else [None] * len(token_ids)
    return [sequence(0, forks=list(siblings) if share_prompt else [], prompt_logprobs=prompt_logprobs), *siblings]


def chat_prompt_ids(tokenizer, messages: list[dict], model_name: str, chat_template: str | None = None,
                    add_generation_prompt: bool = True, tools: list[dict] | None = None,
                    continue_final_message: bool = False, template_variables: dict | None = None) -> list[int]:
    """A conversation through the model's chat template (or the one given), as token ids; tools (OpenAI's
    function definitions) are handed to the template as transformers' apply_chat_template takes them. The
    template writes any special tokens itself, so tokenizing must not add a second BOS. The template's own
    checks (role order, ...) raise ValueError. continue_final_message: the last message, an assistant's, is left
    open for the model to go on with (as transformers does it: the text is cut after that message's content).
    template_variables: extra variables the template reads (enable_thinking, ...), as apply_chat_template's kwargs."""
    if chat_template is None and not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"model {model_name!r} has no chat template; pass chat_template=..., or use completions")
    def render(conversation: list[dict]) -> str:
        try:
            return tokenizer.apply_chat_template(conversation, tokenize=False, chat_template=chat_template, tools=tools,
                                                 add_generation_prompt=add_generation_prompt and not continue_final_message,
                                                 **(template_variables or {}))
        except Exception as e:  # jinja's TemplateError and the template's raise_exception
            raise ValueError(f"the chat template refused these messages: {e}") from None

    text = render(messages)
    if continue_final_message:
        text = _open_final_message(text, messages, render)
    return tokenizer(text, add_special_tokens=False).input_ids


CONTINUE_MARK = "@@SCRIPTORIUM-FINAL-MESSAGE@@"  # no whitespace: a template's trim leaves it whole


def _open_final_message(text: str, messages: list[dict], render) -> str:
    """The rendered conversation cut right after the final message's content, as the template writes it, so that
    what the model writes next continues it. Where that content ends is found by rendering the final message as a
    mark instead: the text before the mark is the same, and the content is as long as the two renderings differ
    (a search for the content itself can meet it in an earlier turn, or in the closing marker)."""
    final = messages[-1] if messages else {}
    content = final.get("content")
    if final.get("role") != "assistant" or not isinstance(content, str) or not content.strip():
        raise ValueError("continuing the final message needs it to be an assistant message with text; end with "
                         "such a message or do not ask to continue it")
    marked = render([*messages[:-1], {**final, "content": CONTINUE_MARK}])
    at = marked.find(CONTINUE_MARK)
    if at < 0 or marked.count(CONTINUE_MARK) != 1 or text[:at] != marked[:at]:
        raise ValueError("the chat template does not write the final assistant message's text once, as given, so "
                         "it cannot be continued; do not ask to continue it")
    return text[:at + len(text) - len(marked) + len(CONTINUE_MARK)]
