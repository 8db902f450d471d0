"""The Responses API's tools as the chat path's function tools, and the model's calls back as output items.

- `function` tools are function tools.
- `namespace` tools (Codex sends every MCP server's tools, and its own groups, as one) offer each function
  inside as `{namespace}__{name}` (or `{namespace}{name}` when the namespace ends in `_`); a call comes back
  as a function_call with the inner `name` and its `namespace`, as Codex expects.
- `custom` (free-form) tools become a function taking one string, `input`; a call comes back as a
  custom_tool_call whose `input` is that string.
- Hosted tools (web_search, file_search, code_interpreter, image_generation, computer_use_preview, mcp,
  local_shell, ...) run on OpenAI's side; nothing here can run them, so they are left out of the prompt
  with a warning in the log, as vLLM does, not refused.
"""

import json
import logging
from dataclasses import dataclass, field

from backend.server.errors import APIError

log = logging.getLogger("backend.server")

CUSTOM_PARAMETERS = {"type": "object", "properties": {"input": {"type": "string"}}, "required": ["input"],
                     "additionalProperties": False}


@dataclass
class ToolNames:
    """What each function the model sees stands for: (kind, namespace, name), kind function or custom."""

    by_model_name: dict[str, tuple[str, str | None, str]] = field(default_factory=dict)

    def model_name(self, name: str, namespace: str | None) -> str:
        if not namespace:
            return name
        return f"{namespace}{name}" if namespace.endswith("_") else f"{namespace}__{name}"

    def add(self, kind: str, name: str, namespace: str | None) -> str:
        shown = self.model_name(name, namespace)
        self.by_model_name[shown] = (kind, namespace, name)
        return shown

    def item(self, call_id: str, item_id: str, model_name: str, arguments: str, status: str) -> dict:
        """A call the model made, as the output item the client expects."""
        kind, namespace, name = self.by_model_name.get(model_name, ("function", None, model_name))
        if kind == "custom":
            try:
                text = json.loads(arguments).get("input", "")
            except (json.JSONDecodeError, AttributeError):
                text = partial_input(arguments)
            return {"type": "custom_tool_call", "id": item_id, "call_id": call_id, "name": name,
                    "input": text if isinstance(text, str) else json.dumps(text), "status": status}
        out = {"type": "function_call", "id": item_id, "call_id": call_id, "name": name, "arguments": arguments,
               "status": status}
        if namespace:
            out["namespace"] = namespace
        return out

    def is_custom(self, model_name: str) -> bool:
        return self.by_model_name.get(model_name, ("function",))[0] == "custom"


def partial_input(arguments: str) -> str:
    """A custom call's input from `{"input": "...` that max_tokens cut short: the string written so far (what the
    model wrote, whole, when it is not that)."""
    head = '{"input": "'
    if not arguments.startswith(head):
        return arguments
    body = arguments[len(head):]
    for end in range(len(body), max(len(body) - 6, -1), -1):  # a cut escape (\u00e) takes up to 6 characters
        try:
            return json.loads('"' + body[:end] + '"')
        except json.JSONDecodeError:
            continue
    return arguments


def _function(tool: dict, names: ToolNames, namespace: str | None) -> dict:
    shown = names.add("function", tool.get("name"), namespace) if isinstance(tool.get("name"), str) else None
    fn = {k: tool[k] for k in ("description", "parameters", "strict") if tool.get(k) is not None}
    return {"type": "function", "function": {"name": shown if shown is not None else tool.get("name"), **fn}}


def _custom(tool: dict, names: ToolNames, namespace: str | None, where: str) -> dict:
    for key, kinds, what in (("name", str, "a string"), ("description", str | None, "a string"),
                             ("format", dict | None, "an object")):
        if not isinstance(tool.get(key), kinds) or (key == "name" and not tool[key]):
            raise APIError(400, f"{where}.{key} must be {what}", param=f"{where}.{key}")
    description = tool.get("description") or ""
    fmt = tool.get("format") or {}
    if fmt.get("type") == "grammar" and fmt.get("definition"):
        description += f"\n\nThe input follows this {fmt.get('syntax', 'grammar')} grammar:\n{fmt['definition']}"
    fn = {"name": names.add("custom", tool.get("name"), namespace), "parameters": CUSTOM_PARAMETERS}
    if description:
        fn["description"] = description.strip()
    return {"type": "function", "function": fn}


def chat_tools(tools: list[dict] | None) -> tuple[list[dict] | None, ToolNames]:
    names = ToolNames()
    if tools is None:
        return None, names
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict):
            raise APIError(400, f"tools[{i}] must be an object", param=f"tools[{i}]")
        kind = tool.get("type")
        if kind == "function":
            out.append(_function(tool, names, None))
        elif kind == "custom":
            out.append(_custom(tool, names, None, f"tools[{i}]"))
        elif kind == "namespace":
            if not isinstance(tool.get("name"), str) or not isinstance(tool.get("tools"), list):
                raise APIError(400, f"tools[{i}]: a namespace needs a name and a list of tools", param=f"tools[{i}]")
            for j, inner in enumerate(tool["tools"]):
                inner_kind = inner.get("type") if isinstance(inner, dict) else None
                if inner_kind not in ("function", "custom"):
                    raise APIError(400, f"tools[{i}].tools[{j}].type: a namespace holds function and custom tools, "
                                   f"got {inner_kind!r}", param=f"tools[{i}].tools[{j}].type")
                if inner_kind == "function":
                    out.append(_function(inner, names, tool["name"]))
                else:
                    out.append(_custom(inner, names, tool["name"], f"tools[{i}].tools[{j}]"))
        else:
            log.warning("tools[%d]: %r tools run on OpenAI's servers, not here; left out of the prompt", i, kind)
    log.debug("tools offered to the model: %s", ", ".join(names.by_model_name) or "none")
    return out or None, names


def chat_tool_choice(choice, names: ToolNames, tools: list[dict] | None):
    """tool_choice for the chat path: a named function or custom tool by the name the model sees."""
    if tools is None:
        return None if choice in (None, "auto", "none") else choice
    if isinstance(choice, dict) and choice.get("type") in ("function", "custom"):
        if not isinstance(choice.get("name"), str) or not isinstance(choice.get("namespace"), str | None):
            raise APIError(400, 'tool_choice must be {"type": "function", "name": ...} (and a "namespace" string, '
                           'if any)', param="tool_choice")
        return {"type": "function", "function": {"name": names.model_name(choice.get("name"), choice.get("namespace"))}}
    return choice


def history_call(item: dict) -> tuple[str, str]:
    """A function_call or custom_tool_call input item as (the name the model saw, the arguments it wrote)."""
    if item.get("type") == "custom_tool_call":
        text = item.get("input")
        return item["name"], json.dumps({"input": text if isinstance(text, str) else ""}, ensure_ascii=False)
    return ToolNames().model_name(item["name"], item.get("namespace")), item["arguments"]
