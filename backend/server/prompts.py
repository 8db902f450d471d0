"""Requests' prompts as token ids, built off the event loop, refused early when they cannot fit.

Tokenizing a large prompt or compiling a large JSON schema takes seconds; on the event loop it would
stall every stream and /health, so both run on a small pool of worker threads. Before that, a prompt
longer than the context is refused from its length in characters alone (Limits.max_prompt_chars).
"""

import asyncio
from concurrent.futures import ThreadPoolExecutor

from backend.engine import admission
from backend.engine.admission import AdmittedRequest, chat_prompt_ids
from backend.engine.llm_engine import LLMEngine
from backend.sampling_params import InvalidParameter, SamplingParams
from backend.server.grammar_lane import compile_in_turn
from backend.server.protocol import APIError

_pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="tokenize")


async def off_loop(fn, *args):
    return await asyncio.get_running_loop().run_in_executor(_pool, fn, *args)


def too_long(limit: int, prompt: str, param: str) -> APIError:
    """admission.too_long's answer as a 400."""
    refusal = admission.too_long(limit, prompt, param)
    return APIError(400, str(refusal), param=param, code=refusal.code)


def check_length(engine: LLMEngine, chars: int, param: str) -> None:
    limit = engine.limits.max_prompt_chars
    if limit is not None and chars > limit:
        raise too_long(engine.max_model_len, f"{chars} characters, more than that many tokens can hold", param)


def token_lists(engine: LLMEngine, value, param: str, max_items: int | None = None) -> list[tuple[list[int], str]]:
    """A prompt (or embeddings' input) of one or several texts or lists of token ids, as lists of token ids, each
    with its name in errors (with max_items, a list of several names its items: input[1]). The ids are checked by
    the engine's validation (LLMEngine.validate_request, Limits.check_embedding)."""
    value = [value] if isinstance(value, str) else value
    if not value:
        raise APIError(400, f"{param} is empty", param=param)
    value = [value] if isinstance(value[0], int) else value
    if max_items is not None and len(value) > max_items:
        raise APIError(400, f"{param} holds at most {max_items} items, got {len(value)}", param=param)
    out = []
    for i, item in enumerate(value):
        where = f"{param}[{i}]" if max_items is not None and len(value) > 1 else param
        if isinstance(item, str):
            check_length(engine, len(item), where)
            item = engine.tokenizer(item).input_ids
        out.append((list(item), where))
    return out


def chat_ids(engine: LLMEngine, messages: list[dict], tools: list[dict] | None = None,
             add_generation_prompt: bool = True, continue_final_message: bool = False,
             template_variables: dict | None = None) -> list[int]:
    """The messages through the model's chat template (as /tokenize shows them too), with the request's extra
    template variables (enable_thinking, ...); a 400 when it refuses them."""
    check_length(engine, sum(len(m.get("content") or "") for m in messages), "messages")
    try:
        return chat_prompt_ids(engine.tokenizer, messages, engine.model_name, tools=tools,
                               add_generation_prompt=add_generation_prompt,
                               continue_final_message=continue_final_message,
                               template_variables=template_variables)
    except ValueError as e:
        raise APIError(400, str(e), param="messages") from None


async def completion_prompts(prompt, engine: LLMEngine) -> list[tuple[list[int], str]]:
    return await off_loop(token_lists, engine, prompt, "prompt")


async def chat_prompt(engine: LLMEngine, messages: list[dict], tools: list[dict] | None = None,
                      continue_final_message: bool = False, add_generation_prompt: bool = True,
                      template_variables: dict | None = None) -> list[int]:
    return await off_loop(chat_ids, engine, messages, tools, add_generation_prompt, continue_final_message,
                          template_variables)


async def check_guided(engine: LLMEngine, params: SamplingParams, param: str = "response_format") -> None:
    """Compile a structured-output schema up front (off the loop and off the engine thread, cached for the
    request itself), so a bad one is a 400 and not an error mid-stream. The limits and the cache are looked at
    first, off the grammar thread: a schema too large, or one compiled before, never waits behind another
    request's compile."""
    if params.guided_json is None:
        return
    limit = engine.config.grammar_compile_timeout
    try:
        if await off_loop(lambda: engine.guided_decoding().compiled(params.guided_json)):  # made on first use
            return
        await compile_in_turn(lambda: engine.guided_matcher(params), limit)
    except InvalidParameter as e:
        message = str(e).replace("guided_json: ", f"{param}: ", 1) if param == "tools" else str(e)
        raise APIError(400, message, param=param) from None
    except TimeoutError:
        # The compile goes on in its thread (server/grammar_lane.py) while the next schema compiles.
        raise APIError(400, f"{param}: compiling its JSON schema took longer than {limit:g} s (serve "
                       "--grammar-compile-timeout); simplify the schema, or send it again later", param=param) from None


async def admit(engine: LLMEngine, prompt: list[int], params: SamplingParams, param: str) -> AdmittedRequest:
    """The engine's one validation of a request (its token ids scanned off the event loop), as a 400 naming the
    field at fault; the engine then queues the result without checking it again."""
    try:
        return await off_loop(engine.validate_request, prompt, params, param)
    except InvalidParameter as e:
        raise APIError(400, str(e), param=e.param, code=e.code) from None
    except ValueError as e:
        raise APIError(400, str(e), param=param) from None


def budget(engine: LLMEngine, prompt_len: int, requested: int | None, param: str, prompt_param: str,
           clamp: bool) -> int:
    """The output tokens a request may generate: what it asked for, or with clamp, at most what the context leaves
    after its prompt (RequestPolicy.max_tokens_past_context); otherwise more than that is vLLM's 400. A request
    for less than one token is passed on for SamplingParams to refuse."""
    limit = engine.max_model_len
    if prompt_len >= limit:
        raise too_long(limit, f"{prompt_len} tokens", prompt_param)
    if requested is None:
        return limit - prompt_len
    if prompt_len + requested > limit:
        if clamp:
            return limit - prompt_len
        # vLLM's wording, which agent clients read to retry with what is left (Hermes does)
        raise APIError(400, f"This model's maximum context length is {limit} tokens. However, you requested "
                       f"{requested} output tokens and your prompt contains at least {prompt_len} input tokens, for a "
                       f"total of at least {prompt_len + requested} tokens. Please reduce the length of the input "
                       f"prompt or the number of requested output tokens ({param}: at most {limit - prompt_len} here).",
                       param=param, code="context_length_exceeded")
    return requested


def clamped_headers(requested: int | None, allowed: list[int]) -> dict[str, str]:
    """The header that tells a client its max_tokens was cut to fit the context: the smallest limit granted."""
    if requested is None or min(allowed) >= requested:
        return {}
    return {CLAMPED_HEADER: str(min(allowed))}


CLAMPED_HEADER = "x-max-tokens-clamped"
