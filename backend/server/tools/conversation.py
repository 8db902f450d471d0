"""A conversation with tool calls in it, as the chat template reads it.

A template that knows tools (it mentions `tools`) gets them with tools=, assistant messages with their
tool_calls (arguments as objects, as transformers' templates expect) and tool messages as they are. A
template that knows none (SmolLM2's, say) gets the Hermes format written out instead: the functions in
the system message, calls as <tool_call> text, results as <tool_response> text from the user. Phi-4-mini's
reads the functions from the system message's own `tools` field (a JSON list, put between <|tool|> markers),
so it gets them there, with calls as <|tool_call|> text and results as <|tool_response|> turns.
"""

import json

from backend.server.errors import APIError
from backend.server.tools.tool_defs import ToolSpec

HERMES_SYSTEM = (
    "You may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n{{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}}\n</tool_call>"
)

PHI4_MINI_TOOLS = "<|tool|>"  # the marker around the functions in Phi-4-mini's template


def check_history(messages: list[dict]) -> None:
    """Assistant tool_calls must carry JSON-object arguments; each tool message must answer one of them."""
    ids: dict[str, str] = {}
    for i, m in enumerate(messages):
        for j, call in enumerate(m.get("tool_calls") or []):
            where = f"messages[{i}].tool_calls[{j}]"
            if m["role"] != "assistant":
                raise APIError(400, f"messages[{i}]: only assistant messages carry tool_calls",
                               param=f"messages[{i}].tool_calls")
            try:
                arguments = json.loads(call["function"]["arguments"])
            except json.JSONDecodeError as e:
                raise APIError(400, f"{where}.function.arguments is not valid JSON: {e}",
                               param=f"{where}.function.arguments") from None
            if not isinstance(arguments, dict):
                raise APIError(400, f"{where}.function.arguments must be a JSON object",
                               param=f"{where}.function.arguments")
            ids[call["id"]] = call["function"]["name"]
        if m["role"] == "tool":
            call_id = m.get("tool_call_id")
            if not call_id:
                raise APIError(400, f"messages[{i}]: a tool message needs tool_call_id",
                               param=f"messages[{i}].tool_call_id")
            if call_id not in ids:
                raise APIError(400, f"messages[{i}].tool_call_id {call_id!r} answers no tool call of an earlier "
                               "assistant message", param=f"messages[{i}].tool_call_id")
            m.setdefault("name", ids[call_id])


def _native(m: dict) -> dict:
    if not m.get("tool_calls"):
        return m
    calls = [{"id": c["id"], "type": "function", "function": {
        "name": c["function"]["name"], "arguments": json.loads(c["function"]["arguments"])}}
        for c in m["tool_calls"]]
    return {**m, "tool_calls": calls}


def _written_out(messages: list[dict], spec: ToolSpec | None) -> list[dict]:
    out: list[dict] = []
    for m in messages:
        if m["role"] == "tool":
            text = f"<tool_response>\n{m['content']}\n</tool_response>"
            if out and out[-1].get("tool_results"):
                out[-1]["content"] += "\n" + text
            else:
                out.append({"role": "user", "content": text, "tool_results": True})
        elif m.get("tool_calls"):
            calls = "\n".join(f"<tool_call>\n{json.dumps({'name': c['function']['name'], 'arguments': json.loads(c['function']['arguments'])})}\n</tool_call>"  # noqa: E501
                              for c in m["tool_calls"])
            out.append({"role": "assistant", "content": f"{m['content']}\n{calls}" if m["content"] else calls})
        else:
            out.append({"role": m["role"], "content": m["content"]})
    for m in out:
        m.pop("tool_results", None)
    if spec is not None and spec.calls_possible:
        system = HERMES_SYSTEM.format(tools="\n".join(json.dumps(t) for t in spec.tools))
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{system}"}
        else:
            out.insert(0, {"role": "system", "content": system})
    return out


def template_input(messages: list[dict], spec: ToolSpec | None, template: str | None
                   ) -> tuple[list[dict], list[dict] | None]:
    """(messages, tools) for the chat template: tools is None when the template is not to see any."""
    if template and PHI4_MINI_TOOLS in template:
        return _phi4_mini(messages, spec), None
    if template and "tools" in template:  # a template that knows tools
        tools = spec.tools if spec is not None and spec.calls_possible else None
        return [_native(m) for m in messages], tools
    if spec is None and not any(m.get("tool_calls") or m["role"] == "tool" for m in messages):
        return messages, None
    return _written_out(messages, spec), None


def _phi4_mini(messages: list[dict], spec: ToolSpec | None) -> list[dict]:
    out = []
    for m in messages:
        if m.get("tool_calls"):
            calls = json.dumps([{"name": c["function"]["name"], "arguments": json.loads(c["function"]["arguments"])}
                                for c in m["tool_calls"]])
            out.append({"role": "assistant", "content": f"{m['content'] or ''}<|tool_call|>{calls}<|/tool_call|>"})
        elif m["role"] == "tool":
            out.append({"role": "tool_response", "content": m["content"]})
        else:
            out.append(dict(m))
    if spec is not None and spec.calls_possible:
        if not out or out[0]["role"] != "system":
            out.insert(0, {"role": "system", "content": ""})
        out[0]["tools"] = json.dumps([t["function"] for t in spec.tools])
    return out
