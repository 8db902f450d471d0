"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API (what Claude Code speaks), on the
chat path: the request becomes a chat request (messages_shapes.py) and runs through the same template,
grammar, reasoning and tool-call parsers; the answer comes back as content blocks (thinking, text, tool_use)."""

import json
import re
import uuid

from fastapi import Request
from pydantic import ValidationError

from backend.server.api_fields import ANTHROPIC_MESSAGES
from backend.server.chat import ChatTools, message, prepare, templated
from backend.server.client_id import client_id
from backend.server.errors import APIError
from backend.server.messages_shapes import (
    CountTokensRequest,
    MessagesRequest,
    chat_request,
    message_usage,
    stop_reason,
    toolu,
)
from backend.server.messages_stream import stream_message
from backend.server.protocol import ChatRequest
from backend.server.state import ServerState
from backend.server.streams import answer, collect, until_disconnect


def new_message_id() -> str:
    return f"msg_{uuid.uuid4().hex[:24]}"


def tool_input(arguments: str) -> dict | None:
    """A call's arguments as tool_use input (an object), or None when they are not a JSON object."""
    try:
        value = json.loads(arguments or "{}")
    except json.JSONDecodeError:
        return None
    return value if isinstance(value, dict) else None


# What a thinking block's signature says here: Anthropic's proves its reasoning came from its servers; a local
# model's has nothing to prove, and nothing here reads it back.
SIGNATURE = ""


def content_blocks(tools: ChatTools, text: str) -> list[dict]:
    msg, _ = message(tools, text, "stop")
    blocks = []
    if msg.get("reasoning_content"):
        blocks.append({"type": "thinking", "thinking": msg["reasoning_content"], "signature": SIGNATURE})
    if msg.get("content"):
        blocks.append({"type": "text", "text": msg["content"]})
    for call in msg.get("tool_calls") or []:
        value = tool_input(call["function"]["arguments"])
        if value is None:  # not an object: what the model wrote, as text
            blocks.append({"type": "text", "text": call["function"]["arguments"]})
        else:
            blocks.append({"type": "tool_use", "id": toolu(call["id"]), "name": call["function"]["name"],
                           "input": value})
    return blocks


def _param(param: str | None, origin: list[str]) -> str | None:
    """A chat request's field as the Messages request names it."""
    if not param:
        return param
    match = re.match(r"messages\[(\d+)\](.*)", param)
    if match:
        index = int(match.group(1))
        return (origin[index] if index < len(origin) else "messages") + (".content" if match.group(2) else "")
    if param.startswith("tools[") and ".function.parameters" in param:
        return param.replace(".function.parameters", ".input_schema")
    renamed = {"max_completion_tokens": "max_tokens", "response_format": "output_format", "stop": "stop_sequences"}
    return renamed.get(param, param.replace(".function", ""))


def _chat(fields: dict, origin: list[str]) -> ChatRequest:
    try:
        return ChatRequest.model_validate(fields)
    except ValidationError as e:
        first = e.errors()[0]
        loc = "".join(f"[{p}]" if isinstance(p, int) else (f".{p}" if i else str(p))
                      for i, p in enumerate(first.get("loc", ())))
        param = _param(loc, origin)
        raise APIError(400, f"{param}: {first['msg']}", param=param) from None


def _renamed(e: APIError, origin: list[str]) -> APIError:
    param = _param(e.param, origin)
    if param != e.param:
        e.message, e.param = f"{e.message} (in this request: {param})", param
    return e


async def create_message(state: ServerState, req: MessagesRequest, request: Request):
    fields, origin = chat_request(req, state.policy.keep_attribution_header)
    chat = _chat(fields, origin)
    try:
        engine, admitted, tools, headers = await prepare(state, chat, ANTHROPIC_MESSAGES)
    except APIError as e:
        raise _renamed(e, origin) from None
    prompt = admitted.token_ids
    mid = new_message_id()
    context_ended = admitted.params.max_tokens < req.max_tokens  # the context leaves less than the client asked
    gen = engine.generate(mid, admitted, client=client_id(request, req))
    if req.stream:
        return answer(stream_message(state.served_model_name, mid, gen, len(prompt), tools, SIGNATURE,
                                     context_ended, state.policy.stream_keepalive), headers)
    (out,) = await until_disconnect(request, collect([gen], [prompt], 1))
    c = out.outputs[0]
    blocks = content_blocks(tools, c.text)
    reason, sequence = stop_reason(c.finish_reason, c.stop_reason, any(b["type"] == "tool_use" for b in blocks),
                                   context_ended)
    return answer({"id": mid, "type": "message", "role": "assistant", "model": state.served_model_name,
                   "content": blocks, "stop_reason": reason, "stop_sequence": sequence,
                   "usage": message_usage(len(prompt), len(c.token_ids), out.num_cached_tokens)}, headers)


async def count_tokens(state: ServerState, req: CountTokensRequest) -> dict:
    """The prompt's tokens as a request with these fields would be sent to the model: template and tools."""
    fields, origin = chat_request(req, state.policy.keep_attribution_header)
    chat = _chat(fields, origin)
    try:
        _, prompt = await templated(state.loaded_engine(), chat)
    except APIError as e:
        raise _renamed(e, origin) from None
    return {"input_tokens": len(prompt)}
