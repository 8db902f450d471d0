"""Anthropic's Messages API request, and its translation to a chat request.

System text becomes the system message; a user turn's tool_result blocks become tool messages (before
its text), an assistant turn's tool_use blocks its tool_calls; tools with input_schema become function
tools; tool_choice auto / any / tool / none become auto / required / named / none. Thinking blocks sent
back are dropped (a local model's reasoning is in its text). A system message in the middle of the
conversation (Claude Code sends them) joins the user turn beside it, as most chat templates allow a
system message only first; turns of one role in a row are joined, as templates that alternate need.
"""

import json
import logging

from pydantic import ConfigDict, Field

from backend.server.errors import APIError
from backend.server.protocol import UnicodeBody, text_of

log = logging.getLogger("backend.server")


class CountTokensRequest(UnicodeBody):
    # Anthropic refuses fields it does not know ("x: Extra inputs are not permitted"); so do we. The fields
    # here and in MessagesRequest are all those its API reference lists, beta ones included, so a client never
    # meets a 400 here for a field Anthropic's own API takes.
    model_config = ConfigDict(extra="forbid")

    model: str
    messages: list[dict] = Field(min_length=1)
    system: str | list[dict] | None = None
    tools: list[dict] | None = None
    tool_choice: dict | None = None
    thinking: dict | None = None  # enabled / disabled: the chat template's enable_thinking switch
    output_format: dict | None = None  # {"type": "json_schema", "schema": ...}: structured output
    output_config: dict | None = None  # {"effort": ..., "format": ...}: format as output_format
    context_management: dict | None = None
    mcp_servers: list[dict] | None = None
    cache_control: dict | None = None


class MessagesRequest(CountTokensRequest):  # what count_tokens takes, and how to generate
    max_tokens: int
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    metadata: dict | None = None
    service_tier: str | None = None
    container: str | dict | None = None
    inference_geo: str | None = None
    speed: str | None = None
    diagnostics: dict | None = None
    user_profile_id: str | None = None
    workspace_id: str | None = None


def _turn(i: int, message: dict) -> list[dict]:
    """One Anthropic message as chat messages: tool results first, then the text (and the turn's calls)."""
    where = f"messages[{i}]"
    role, content = message.get("role"), message.get("content")
    if role not in ("user", "assistant", "system"):
        raise APIError(400, f"{where}.role: expected user or assistant, got {role!r}", param=f"{where}.role")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise APIError(400, f"{where}.content: expected a string or a list of content blocks",
                       param=f"{where}.content")
    results, texts, calls, thoughts = [], [], [], []
    for j, block in enumerate(content):
        here = f"{where}.content[{j}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            texts.append(str(block.get("text", "")))
        elif kind == "thinking" and role == "assistant":
            thoughts.append(str(block.get("thinking", "")))
        elif kind in ("thinking", "redacted_thinking"):
            continue
        elif kind == "tool_use" and role == "assistant":
            if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str):
                raise APIError(400, f"{here}: a tool_use block needs id and name", param=here)
            calls.append({"id": block["id"], "type": "function", "function": {
                "name": block["name"], "arguments": json.dumps(block.get("input") or {}, ensure_ascii=False)}})
        elif kind == "tool_result" and role == "user":
            if not isinstance(block.get("tool_use_id"), str):
                raise APIError(400, f"{here}.tool_use_id is required", param=f"{here}.tool_use_id")
            text = text_of(block.get("content", ""), f"{here}.content", separator="\n")
            if block.get("is_error"):
                text = f"Error: {text}"
            results.append({"role": "tool", "tool_call_id": block["tool_use_id"], "content": text})
        elif kind in ("image", "document", "search_result"):
            raise APIError(400, f"{here}: {kind} blocks are not supported (this server's models read text only); "
                           "send the content as text", param=here)
        else:
            raise APIError(400, f"{here}: unexpected block type {kind!r} in a {role} message", param=here)
    turn = results
    if texts or calls or thoughts or not results:
        message = {"role": role, "content": "\n".join(texts)}
        if calls:
            message["tool_calls"] = calls
        if any(thoughts):
            message["reasoning_content"] = "\n".join(t for t in thoughts if t)
        turn.append(message)
    return turn


# Lines a client writes into the system prompt for its provider's accounting, not for the model. Claude Code's
# differs every request (a hash of the prompt), and first in the prompt it would leave no prefix to cache.
ATTRIBUTION_PREFIXES = ("x-anthropic-billing-header:",)


def without_attribution(system: str | list) -> str | list:
    """The system prompt without attribution lines: a text block that is one is dropped, and such a line is cut
    from a string or a block that holds more (the rest of the text kept byte for byte)."""
    def cut(text: str) -> str:
        lines = text.splitlines(keepends=True)
        return "".join(line for line in lines if not line.lstrip().startswith(ATTRIBUTION_PREFIXES))

    if isinstance(system, str):
        return cut(system)
    if not isinstance(system, list):
        return system
    kept = []
    for block in system:
        if isinstance(block, dict) and block.get("type") == "text" and isinstance(block.get("text"), str):
            text = cut(block["text"])
            if not text.strip() and block["text"].strip():
                continue  # the block was the attribution line alone
            block = {**block, "text": text}
        kept.append(block)
    return kept


def chat_messages(req: CountTokensRequest, keep_attribution: bool = False
                  ) -> tuple[list[dict], list[str]]:
    """The chat messages of a request, and for each the Anthropic field it came from (for errors)."""
    messages: list[dict] = []
    origin: list[str] = []
    system = req.system if keep_attribution or not req.system else without_attribution(req.system)
    if system:
        messages.append({"role": "system", "content": text_of(system, "system", separator="\n")})
        origin.append("system")
    for i, message in enumerate(req.messages):
        if not isinstance(message, dict):
            raise APIError(400, f"messages[{i}]: expected an object", param=f"messages[{i}]")
        for m in _turn(i, message):
            if m["role"] == "system" and messages:  # mid-conversation: with the user's turn
                m = {"role": "user", "content": m["content"]}
            last = messages[-1] if messages else None
            if (last is not None and last["role"] == m["role"] and m["role"] in ("user", "system")
                    and "tool_calls" not in m):
                last["content"] = f"{last['content']}\n\n{m['content']}" if last["content"] else m["content"]
                continue
            messages.append(m)
            origin.append(f"messages[{i}]")
    return messages, origin


def chat_tools(tools: list[dict] | None) -> list[dict] | None:
    """Custom tools as function tools. Anthropic's server and client tools with a fixed schema (web search,
    bash, text editor, ...) cannot run here and have no schema to show the model: they are left out."""
    if tools is None:
        return None
    out = []
    for i, tool in enumerate(tools):
        if tool.get("type", "custom") != "custom":
            log.warning("tools[%d]: %s tools cannot run on this server; left out of the prompt", i, tool.get("type"))
            continue
        if not isinstance(tool.get("name"), str):
            raise APIError(400, f"tools[{i}].name is required", param=f"tools[{i}].name")
        if not isinstance(tool.get("input_schema"), dict):
            raise APIError(400, f"tools[{i}].input_schema is required (a JSON schema object)",
                           param=f"tools[{i}].input_schema")
        fn = {"name": tool["name"], "parameters": tool["input_schema"]}
        if tool.get("description"):
            fn["description"] = tool["description"]
        out.append({"type": "function", "function": fn})
    return out or None


def chat_tool_choice(choice: dict | None, tools: list[dict] | None) -> tuple[str | dict | None, bool | None]:
    """tool_choice as (chat tool_choice, parallel_tool_calls)."""
    if choice is None:
        return None, None
    kind = choice.get("type")
    parallel = None if choice.get("disable_parallel_tool_use") is None else not choice["disable_parallel_tool_use"]
    if tools is None:
        if kind in ("auto", "none"):
            return None, None
        raise APIError(400, f"tool_choice {kind!r} needs tools", param="tool_choice")
    if kind in ("auto", "none"):
        return kind, parallel
    if kind == "any":
        return "required", parallel
    if kind == "tool":
        if not isinstance(choice.get("name"), str):
            raise APIError(400, "tool_choice.name is required when tool_choice.type is 'tool'", param="tool_choice.name")
        return {"type": "function", "function": {"name": choice["name"]}}, parallel
    raise APIError(400, f"tool_choice.type must be auto, any, tool or none, got {kind!r}", param="tool_choice.type")


def response_format(req: CountTokensRequest) -> dict | None:
    fmt = req.output_format or (req.output_config or {}).get("format")
    if fmt is None:
        return None
    if fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
        raise APIError(400, 'output_format must be {"type": "json_schema", "schema": {...}}', param="output_format")
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}}


def chat_request(req: CountTokensRequest, keep_attribution: bool = False
                 ) -> tuple[dict, list[str]]:
    """The chat request's fields (for ChatRequest) and the origin of each of its messages."""
    if req.mcp_servers:
        raise APIError(400, "mcp_servers: this server does not connect to MCP servers itself; register them with "
                       "your client instead", param="mcp_servers")
    messages, origin = chat_messages(req, keep_attribution)
    tools = chat_tools(req.tools)
    choice, parallel = chat_tool_choice(req.tool_choice, tools)
    chat = {"model": req.model, "messages": messages, "tools": tools, "tool_choice": choice,
            "parallel_tool_calls": parallel, "response_format": response_format(req)}
    switch = thinking_switch(req.thinking)
    if switch is not None:
        chat["chat_template_kwargs"] = {"enable_thinking": switch}
    if messages and messages[-1]["role"] == "assistant" and not messages[-1].get("tool_calls"):
        chat["continue_final_message"] = True  # a prefill: the answer goes on from it, and holds only what follows
    if isinstance(req, MessagesRequest):  # checked with Anthropic's ranges (api_fields.py) as the chat request runs
        chat.update(max_completion_tokens=req.max_tokens, stop=req.stop_sequences, temperature=req.temperature,
                    top_p=req.top_p, top_k=req.top_k)
    return {k: v for k, v in chat.items() if v is not None}, origin


def thinking_switch(thinking: dict | None) -> bool | None:
    """Anthropic's thinking setting as the template's enable_thinking (None: the template's default)."""
    kind = thinking.get("type") if isinstance(thinking, dict) else None
    if kind is None:
        return None
    if kind not in ("enabled", "disabled", "adaptive"):
        raise APIError(400, f"thinking.type must be enabled, disabled or adaptive, got {kind!r}", param="thinking.type")
    return kind != "disabled"


def stop_reason(finish_reason: str | None, stop: int | str | None, calls: bool,
                context_ended: bool = False) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of a finished choice. context_ended: its length limit was the context's, the
    client's max_tokens cut to what the prompt left (Anthropic's model_context_window_exceeded), not max_tokens."""
    if finish_reason == "length":
        return ("model_context_window_exceeded" if context_ended else "max_tokens"), None
    if calls:
        return "tool_use", None
    if isinstance(stop, str):
        return "stop_sequence", stop
    return "end_turn", None


def message_usage(prompt_tokens: int, output_tokens: int, cached: int) -> dict:
    # Anthropic counts cache reads apart from input_tokens: their sum is the whole prompt.
    return {"input_tokens": prompt_tokens - cached, "output_tokens": output_tokens,
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached}


def toolu(call_id: str) -> str:
    return "toolu_" + call_id.removeprefix("call_")
