"""POST /v1/responses: OpenAI's Responses API (what Codex and the OpenAI Agents SDK speak), on the chat path.

A request becomes a chat request (instructions as the system message, input items as messages: a
function_call or custom_tool_call item as an assistant tool call, their outputs as tool messages; tools
as responses_tools.py lays them out), runs through the same template, grammar and parsers, and comes
back as output items: the reasoning (where the model's format has it), a message with output_text,
function_call and custom_tool_call items. A reasoning item sent back goes with the assistant turn after it. Nothing is stored: `store` is accepted and nothing is kept, so
previous_response_id is a 400.
"""

import re
import time

from fastapi import Request
from pydantic import ValidationError

from backend.server.api_fields import OPENAI_RESPONSES
from backend.server.chat import ChatTools, message, prepare
from backend.server.client_id import client_id
from backend.server.errors import APIError
from backend.server.protocol import ChatRequest, text_of
from backend.server.reasoning import effort_switches
from backend.server.responses_shapes import (
    ResponsesRequest,
    message_item,
    new_item_id,
    reasoning_item,
    response_body,
    response_usage,
)
from backend.server.responses_stream import stream_response
from backend.server.responses_tools import ToolNames, chat_tool_choice, chat_tools, history_call
from backend.server.state import ServerState
from backend.server.streams import answer, collect, until_disconnect

TEXT_PARTS = ("input_text", "output_text", "text")  # the part types an input item's text comes in


def to_messages(req: ResponsesRequest) -> tuple[list[dict], list[list[str]]]:
    """The chat messages of a request, and for each the input fields it came from (for errors' param): one,
    or for an assistant turn of calls, one per call."""
    messages: list[dict] = []
    origin: list[list[str]] = []
    if req.instructions:
        messages.append({"role": "system", "content": req.instructions})
        origin.append(["instructions"])
    items = [{"role": "user", "content": req.input}] if isinstance(req.input, str) else req.input
    calls_open = False  # the last message is an assistant turn of calls that the next call joins
    thought = ""  # a reasoning item's text, for the assistant turn that follows it
    for i, item in enumerate(items):
        where = "input" if isinstance(req.input, str) else f"input[{i}]"
        if not isinstance(item, dict):
            raise APIError(400, f"{where} must be an object", param=where)
        kind = item.get("type", "message")
        if kind in ("function_call", "custom_tool_call"):
            needed = ("call_id", "name", "arguments") if kind == "function_call" else ("call_id", "name", "input")
            for key in needed:
                if not isinstance(item.get(key), str):
                    raise APIError(400, f"{where}.{key} is required (a string)", param=f"{where}.{key}")
            if not isinstance(item.get("namespace", ""), str | None):
                raise APIError(400, f"{where}.namespace must be a string", param=f"{where}.namespace")
            name, arguments = history_call(item)
            call = {"id": item["call_id"], "type": "function", "function": {"name": name, "arguments": arguments}}
            if calls_open:
                messages[-1]["tool_calls"].append(call)
                origin[-1].append(where)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
                origin.append([where])
                if thought:
                    messages[-1]["reasoning_content"], thought = thought, ""
            calls_open = True
            continue
        calls_open = False
        if kind == "message":
            if item.get("role") not in ("user", "system", "developer", "assistant"):
                raise APIError(400, f"{where}.role must be user, system, developer or assistant", param=f"{where}.role")
            text = text_of(item.get("content", ""), f"{where}.content", TEXT_PARTS)
            role = "system" if item["role"] == "developer" else item["role"]
            if role == "system" and messages and messages[-1]["role"] == "system":
                # Codex sends its instructions as several developer messages; templates want one system message
                messages[-1]["content"] += "\n\n" + text
                continue
            messages.append({"role": role, "content": text})
            if role == "assistant" and thought:
                messages[-1]["reasoning_content"], thought = thought, ""
        elif kind in ("function_call_output", "custom_tool_call_output"):
            output = item.get("output")
            messages.append({"role": "tool", "tool_call_id": item.get("call_id"),
                             "content": text_of(output, f"{where}.output", TEXT_PARTS)})
        elif kind == "reasoning":
            parts = item.get("content") or item.get("summary") or []
            thought = "".join(str(p.get("text", "")) for p in parts if isinstance(p, dict))
            continue
        else:
            raise APIError(400, f"{where}.type {kind!r} is not supported; use message, function_call, "
                           "function_call_output, custom_tool_call or custom_tool_call_output", param=f"{where}.type")
        origin.append([where])
    if not messages:
        raise APIError(400, "input is empty", param="input")
    return messages, origin


def _effort(reasoning: dict | None) -> str | None:
    effort = (reasoning or {}).get("effort")
    if effort is not None and not isinstance(effort, str):
        raise APIError(400, "reasoning.effort must be a string such as \"low\" or \"none\"", param="reasoning.effort")
    return effort


def _response_format(text: dict | None) -> dict | None:
    fmt = (text or {}).get("format")
    if fmt is not None and not isinstance(fmt, dict):
        raise APIError(400, 'text.format must be an object such as {"type": "json_object"}', param="text.format")
    if fmt and fmt.get("type") == "json_schema":
        return {"type": "json_schema", "json_schema": {"name": fmt.get("name"), "schema": fmt.get("schema")}}
    return fmt


def _param(param: str | None, origin: list[list[str]]) -> str | None:
    """A chat request's field as the responses request names it."""
    if not param:
        return param
    match = re.match(r"messages\[(\d+)\](?:\.tool_calls\[(\d+)\](?:\.function)?)?(.*)", param)
    if match:
        index, call, rest = int(match.group(1)), match.group(2), match.group(3)
        wheres = origin[index] if index < len(origin) else ["input"]
        where = wheres[min(int(call), len(wheres) - 1)] if call is not None else wheres[0]
        return where + rest.replace(".tool_call_id", ".call_id")
    if param.startswith("tools[") and ".function" in param:
        return param.replace(".function", "", 1)
    renamed = {"max_completion_tokens": "max_output_tokens", "response_format": "text.format"}
    return renamed.get(param, param)


def _validation_param(e: ValidationError) -> str:
    loc = e.errors()[0].get("loc", ()) if e.errors() else ()
    return "".join(f"[{p}]" if isinstance(p, int) else (f".{p}" if i else str(p)) for i, p in enumerate(loc))


async def prepare_response(state: ServerState, req: ResponsesRequest):
    if req.previous_response_id is not None:
        raise APIError(400, "previous_response_id is not supported: this server keeps no responses (store is "
                       "ignored); send the whole conversation as input", param="previous_response_id")
    messages, origin = to_messages(req)
    tools, names = chat_tools(req.tools)
    chat = {"model": req.model, "messages": messages, "tools": tools,
            "tool_choice": chat_tool_choice(req.tool_choice, names, tools),
            "parallel_tool_calls": req.parallel_tool_calls, "max_completion_tokens": req.max_output_tokens,
            "temperature": req.temperature, "top_p": req.top_p, "seed": req.seed,
            "response_format": _response_format(req.text),
            "chat_template_kwargs": effort_switches(_effort(req.reasoning)) or None}
    try:
        try:
            chat_req = ChatRequest.model_validate({k: v for k, v in chat.items() if v is not None})
        except ValidationError as e:
            param = _validation_param(e)
            raise APIError(400, f"{param}: {e.errors()[0]['msg']}", param=param) from None
        return *await prepare(state, chat_req, OPENAI_RESPONSES), names
    except APIError as e:
        param = _param(e.param, origin)
        if param != e.param:  # the message names the chat request's field
            e.message, e.param = f"{e.message} (in this request: {param})", param
        raise


def output_items(tools: ChatTools, names: ToolNames, text: str, reason: str | None) -> list[dict]:
    msg, _ = message(tools, text, reason)
    status = "incomplete" if reason == "length" else "completed"
    items = []
    if msg.get("reasoning_content"):
        items.append(reasoning_item(new_item_id("rs"), msg["reasoning_content"], status))
    if msg.get("content"):
        items.append(message_item(new_item_id("msg"), msg["content"], status))
    for call in msg.get("tool_calls") or []:
        fn = call["function"]
        items.append(names.item(call["id"], new_item_id("fc"), fn["name"], fn["arguments"], status))
    return items


async def create_response(state: ServerState, req: ResponsesRequest, request: Request):
    engine, admitted, tools, headers, names = await prepare_response(state, req)
    prompt = admitted.token_ids
    rid, created = new_item_id("resp"), time.time()
    gen = engine.generate(rid, admitted, client=client_id(request, req))
    if req.stream:
        return answer(stream_response(state.served_model_name, req, rid, created, gen, len(prompt), tools, names,
                                      state.policy.stream_keepalive), headers)
    (out,) = await until_disconnect(request, collect([gen], [prompt], 1))
    c = out.outputs[0]
    status = "incomplete" if c.finish_reason == "length" else "completed"
    return answer(response_body(req, rid, state.served_model_name, created, status,
                                output_items(tools, names, c.text, c.finish_reason),
                                response_usage(len(prompt), len(c.token_ids), out.num_cached_tokens,
                                               tools.reasoning_tokens(c.token_ids))), headers)
