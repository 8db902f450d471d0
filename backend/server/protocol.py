"""OpenAI's request and response shapes, and their translation to and from the engine's."""

import logging
import time
import uuid
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from backend.outputs import Logprob
from backend.sampling_params import ApiFields, InvalidParameter, SamplingParams
from backend.server.api_fields import OPENAI_COMPLETIONS
from backend.server.errors import APIError  # noqa: F401 re-exported: the routes raise it from here
from backend.server.prompt_logprobs_shapes import completion_logprobs, json_logprob, token_text
from backend.server.tools.tool_defs import ToolDef

log = logging.getLogger("backend.server")


def _lone_surrogate(value, path: str) -> str | None:
    """The path of the first string holding a lone UTF-16 surrogate (JSON's "\ud800" escapes make them), which
    no tokenizer can encode, or None."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path or "body"
    elif isinstance(value, dict):
        for key, item in value.items():
            found = _lone_surrogate(key, path) or _lone_surrogate(item, f"{path}.{key}" if path else str(key))
            if found:
                return found
    elif isinstance(value, list):
        for i, item in enumerate(value):
            found = _lone_surrogate(item, f"{path}[{i}]")
            if found:
                return found
    return None


class StreamOptions(BaseModel):
    include_usage: bool = False


class UnicodeBody(BaseModel):
    """A request body whose every string is valid Unicode (a 400 naming the first one that is not)."""

    @model_validator(mode="before")
    @classmethod
    def _valid_text(cls, data):
        where = _lone_surrogate(data, "")
        if where:
            raise ValueError(f"{where} holds a lone surrogate (an unpaired \\ud800-\\udfff escape), which is not "
                             "valid Unicode text; send UTF-8 text")
        return data


# vLLM's request fields that change what is generated and that this server does not do, with their defaults: a
# request that sets one otherwise is refused, rather than answered as if it had not been sent.
UNSUPPORTED = {"use_beam_search": False, "length_penalty": 1.0, "min_tokens": 0, "bad_words": [],
               "guided_regex": None, "guided_choice": None, "guided_grammar": None, "structural_tag": None,
               "include_stop_str_in_output": False, "truncate_prompt_tokens": None,
               "prompt_embeds": None, "echo": False}
_logged_extras: set[tuple[str, frozenset]] = set()


class OpenAIBody(UnicodeBody):
    """An OpenAI-style request: fields it does not declare are accepted and ignored, as OpenAI's API and vLLM's do,
    and named in the log (once per route and set of names); vLLM's that would change the output are refused."""

    model_config = ConfigDict(extra="allow")

    @model_validator(mode="after")
    def _extras(self):
        extra = self.model_extra or {}
        for name, default in UNSUPPORTED.items():
            if name in extra and extra[name] != default and not (default is None and extra[name] in ([], "")):
                raise ValueError(f"{name} is not supported by this server; leave it out (or at {default!r})")
        key = (type(self).__name__, frozenset(extra))
        if extra and key not in _logged_extras:
            _logged_extras.add(key)
            log.warning("%s: ignored fields the server does not use: %s", type(self).__name__, ", ".join(sorted(extra)))
        return self


class CommonRequest(OpenAIBody):

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    max_tokens: int | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # vLLM's extensions
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    guided_json: dict | str | None = None
    response_format: dict | None = None  # {"type": "text" | "json_object" | "json_schema", "json_schema": {...}}
    logit_bias: dict[str, float] | None = None  # token id (as a string) -> bias in [-100, 100]
    allowed_token_ids: list[int] | None = None
    prompt_logprobs: int | None = None  # the prompt tokens' logprobs, with this many top ones (vLLM's)
    skip_special_tokens: bool = True  # vLLM's: special tokens left out of the text


class CompletionRequest(CommonRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text


class ToolCallIn(BaseModel):
    model_config = ConfigDict(extra="allow")
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class TextPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    tool_calls: list[ToolCallIn] | None = None  # assistant messages
    tool_call_id: str | None = None  # tool messages
    name: str | None = None


class ChatRequest(CommonRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = None
    max_completion_tokens: int | None = None
    tools: list[ToolDef] | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None
    continue_final_message: bool = False  # vLLM's: the last message, an assistant's, is continued, not answered
    chat_template_kwargs: dict | None = None  # vLLM's: the chat template's extra variables (enable_thinking, ...)
    reasoning_effort: str | None = None  # OpenAI's: none/minimal turn a template's thinking switch off


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def guided_json(req: CommonRequest) -> dict | str | bool | None:
    """OpenAI's response_format (or vLLM's guided_json) as the engine's guided_json."""
    fmt = req.response_format
    kind = fmt.get("type") if fmt is not None else "text"
    if kind == "text":
        return req.guided_json
    if kind == "json_object":
        return True
    if kind == "json_schema":
        wrapper = fmt.get("json_schema")
        schema = wrapper.get("schema") if isinstance(wrapper, dict) else None
        if not isinstance(schema, dict):
            raise APIError(400, "response_format.json_schema.schema must be a JSON schema object",
                           param="response_format")
        return schema
    raise APIError(400, f"response_format type {kind!r} is not supported; use text, json_object or json_schema",
                   param="response_format")


def sampling_params(req: CommonRequest, max_tokens: int, logprobs: int | None, guided: dict | None = None,
                    skip_special_tokens: bool = True, prompt_logprobs: int | None = None,
                    api: ApiFields = OPENAI_COMPLETIONS) -> SamplingParams:
    """The request's sampling settings, checked by SamplingParams with the API's ranges (a 400 naming the field as
    the API names it); guided (a tool call's schema) replaces response_format's; prompt_logprobs (echo's) replaces
    the request's own."""
    if req.stream_options is not None and not req.stream:
        raise APIError(400, "stream_options is only allowed when stream is true", param="stream_options")
    try:
        return SamplingParams(
            n=req.n, temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p, top_k=req.top_k or 0, min_p=req.min_p or 0.0,
            seed=req.seed, presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
            repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
            max_tokens=max_tokens, stop=req.stop, stop_token_ids=req.stop_token_ids or [], ignore_eos=req.ignore_eos,
            logprobs=logprobs, guided_json=guided if guided is not None else guided_json(req),
            skip_special_tokens=skip_special_tokens and req.skip_special_tokens, logit_bias=req.logit_bias, allowed_token_ids=req.allowed_token_ids,
            prompt_logprobs=req.prompt_logprobs if prompt_logprobs is None else prompt_logprobs, api=api)
    except InvalidParameter as e:
        raise APIError(400, str(e), param=e.param, code=e.code) from None


def text_of(content, where: str, kinds: tuple[str, ...] = ("text",), separator: str = "") -> str:
    """Content sent as a string or as a list of text parts (of these types) as one text, the parts joined by
    separator; a 400 naming the first part that is not text (this server's models read text only)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, f"{where} must be a string or a list of text parts", param=where)
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        if kind not in kinds:
            raise APIError(400, f"{where}[{j}]: {kind!r} parts are not supported here (this server's models read "
                           "text only); send the content as text", param=f"{where}[{j}]")
        texts.append(str(part.get("text", "")))
    return separator.join(texts)


def chat_messages(req: ChatRequest) -> list[dict]:
    messages = []
    for i, m in enumerate(req.messages):
        content = m.content
        if content is None and m.role != "assistant":  # an assistant's turn may be calls alone
            raise APIError(400, f"messages[{i}].content is required for a {m.role} message",
                           param=f"messages[{i}].content")
        if isinstance(content, list):
            texts = []
            for part in content:
                if part.type != "text":
                    raise APIError(400, f"messages[{i}].content: only text parts are supported, got {part.type!r}",
                                   param=f"messages[{i}].content")
                if part.text is None:
                    raise APIError(400, f"messages[{i}].content: a text part needs its text", param=f"messages[{i}].content")
                texts.append(part.text)
            content = "".join(texts)
        message = {"role": "system" if m.role == "developer" else m.role, "content": content or ""}
        if m.tool_calls:
            message["tool_calls"] = [c.model_dump() for c in m.tool_calls]
        reasoning = (m.model_extra or {}).get("reasoning_content") or (m.model_extra or {}).get("reasoning")
        if m.role == "assistant" and isinstance(reasoning, str) and reasoning:
            message["reasoning_content"] = reasoning  # reasoning sent back: the template renders it as it expects
        if m.role == "tool":
            message["tool_call_id"] = m.tool_call_id
            if m.name:
                message["name"] = m.name
        messages.append(message)
    return messages


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0, reasoning_tokens: int = 0) -> dict:
    """OpenAI's usage object; cached_tokens: the prompt's tokens read from the prefix cache; reasoning_tokens: the
    completion's tokens spent reasoning."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens},
            "completion_tokens_details": {"reasoning_tokens": reasoning_tokens}}


def chat_logprobs(entries: list[dict[int, Logprob]], token_ids: list[int], top: int) -> dict:
    content = []
    for token, entry in zip(token_ids, entries):
        chosen = entry[token]
        others = sorted(entry.values(), key=lambda lp: lp.rank)[:top]
        content.append({
            "token": token_text(chosen), "logprob": json_logprob(chosen.logprob),
            "bytes": list(token_text(chosen).encode()),
            "top_logprobs": [{"token": token_text(lp), "logprob": json_logprob(lp.logprob),
                              "bytes": list(token_text(lp).encode())} for lp in others],
        })
    return {"content": content}


def completion_choice(index: int, text: str, token_ids: list[int], entries: list[dict[int, Logprob]] | None,
                      logprobs: int | None, finish_reason: str | None, offset: int = 0) -> dict:
    """A completion choice (or a streamed piece of one, offset: the characters sent before it)."""
    lp = None
    if logprobs is not None and entries is not None:
        lp = completion_logprobs(entries, token_ids, logprobs, offset)
    return {"index": index, "text": text, "logprobs": lp, "finish_reason": finish_reason}


def now() -> int:
    return int(time.time())
