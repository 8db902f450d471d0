"""A request's tools and tool_choice, checked (a 400 naming the field for anything wrong), and the grammar
that makes a required or named tool_choice produce a call whose arguments match the function's schema."""

import re
from dataclasses import dataclass

import jsonschema
from pydantic import BaseModel, ConfigDict

from backend.server.errors import APIError

NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
CHOICES = ("none", "auto", "required")


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class ToolDef(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str
    function: FunctionDef | None = None


@dataclass
class ToolSpec:
    tools: list[dict]  # {"type": "function", "function": {...}}, as chat templates take them
    choice: str  # none, auto, required, or named
    function: str | None = None  # the function a named choice names
    parallel: bool = True

    @property
    def calls_possible(self) -> bool:
        return self.choice != "none"

    def parameters(self, name: str) -> dict:
        for tool in self.tools:
            if tool["function"]["name"] == name:
                return object_schema(tool["function"].get("parameters"))
        raise KeyError(name)

    def guided_json(self) -> dict | None:
        """The JSON schema the output must match: the named function's arguments, or an array of calls (of
        one call when parallel_tool_calls is false) for required; None when the model chooses."""
        if self.choice == "named":
            return self.parameters(self.function)
        if self.choice != "required":
            return None
        # Each function's schema sits under the root's $defs, its own references ("#/$defs/Unit", "#") moved
        # with it: inside the array of calls, a reference from the root would miss them.
        names = [t["function"]["name"] for t in self.tools]
        defs = {f"tool{i}": _moved_refs(self.parameters(name), f"#/$defs/tool{i}") for i, name in enumerate(names)}
        calls = [{"type": "object", "properties": {"name": {"const": name}, "arguments": {"$ref": f"#/$defs/tool{i}"}},
                  "required": ["name", "arguments"], "additionalProperties": False} for i, name in enumerate(names)]
        array = {"$defs": defs, "type": "array", "minItems": 1,
                 "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}
        if not self.parallel:
            array["maxItems"] = 1
        return array


LITERALS = ("const", "enum", "default", "examples")  # values, not schemas: a "$ref" inside one is data
NAMED = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")  # name -> schema maps


def _moved_refs(schema, prefix: str):
    """The schema with every local reference (a "#" or "#/..." JSON pointer) made relative to `prefix`, where it now
    sits; an "$id" is dropped, as references would resolve against it rather than against the new root."""
    if isinstance(schema, list):
        return [_moved_refs(value, prefix) for value in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key == "$id":
            continue
        if key == "$ref" and isinstance(value, str) and (value == "#" or value.startswith("#/")):
            out[key] = prefix + value[1:]
        elif key in LITERALS:
            out[key] = value
        elif key in NAMED and isinstance(value, dict):  # its keys are names (a property called "enum"), not keywords
            out[key] = {name: _moved_refs(sub, prefix) for name, sub in value.items()}
        else:
            out[key] = _moved_refs(value, prefix)
    return out


def object_schema(parameters: dict | None) -> dict:
    """A function's parameters as a schema of an object (none given: an object with no properties)."""
    if not parameters:
        return {"type": "object", "properties": {}}
    return parameters if "type" in parameters else {"type": "object", **parameters}


def _check_function(i: int, tool: ToolDef, seen: set[str]) -> dict:
    where = f"tools[{i}]"
    if tool.type != "function":
        raise APIError(400, f"{where}.type: only function tools are supported, got {tool.type!r}",
                       param=f"{where}.type")
    if tool.function is None:
        raise APIError(400, f"{where}.function is required", param=f"{where}.function")
    fn = tool.function
    if not NAME.fullmatch(fn.name):
        raise APIError(400, f"{where}.function.name must be 1-64 letters, digits, underscores or dashes, got "
                       f"{fn.name!r}", param=f"{where}.function.name")
    if fn.name in seen:
        raise APIError(400, f"{where}.function.name: the function {fn.name!r} is defined twice",
                       param=f"{where}.function.name")
    seen.add(fn.name)
    if fn.parameters is not None:
        param = f"{where}.function.parameters"
        try:
            jsonschema.validators.validator_for(fn.parameters).check_schema(fn.parameters)
        except jsonschema.SchemaError as e:
            raise APIError(400, f"{param} is not a valid JSON schema: {e.message}", param=param) from None
        if fn.parameters.get("type", "object") != "object":
            raise APIError(400, f"{param} must be the schema of an object (type: object), got type "
                           f"{fn.parameters.get('type')!r}", param=param)
    return {"type": "function", "function": fn.model_dump(exclude_none=True)}


def check_tools(tools: list[ToolDef] | None, tool_choice, parallel_tool_calls: bool | None,
                response_format: dict | None) -> ToolSpec | None:
    """The request's tools as a ToolSpec (None when it has none); a 400 naming the field otherwise."""
    if tools is None:
        if tool_choice is not None and tool_choice != "none":
            raise APIError(400, "tool_choice is only allowed when tools are given", param="tool_choice")
        return None
    if not tools:
        raise APIError(400, "tools must hold at least one tool (or be left out)", param="tools")
    seen: set[str] = set()
    definitions = [_check_function(i, t, seen) for i, t in enumerate(tools)]
    choice, function = "auto", None
    if isinstance(tool_choice, str):
        if tool_choice not in CHOICES:
            raise APIError(400, f"tool_choice must be one of {', '.join(CHOICES)} or a named function, got "
                           f"{tool_choice!r}", param="tool_choice")
        choice = tool_choice
    elif isinstance(tool_choice, dict):
        named = tool_choice.get("function") if tool_choice.get("type") == "function" else None
        function = named.get("name") if isinstance(named, dict) else None
        if not isinstance(function, str):
            raise APIError(400, 'tool_choice must be {"type": "function", "function": {"name": ...}}',
                           param="tool_choice")
        if function not in seen:
            raise APIError(400, f"tool_choice names the function {function!r}, which tools does not define",
                           param="tool_choice")
        choice = "named"
    elif tool_choice is not None:
        raise APIError(400, "tool_choice must be a string or an object", param="tool_choice")
    if choice in ("required", "named") and response_format and response_format.get("type") != "text":
        raise APIError(400, f"tool_choice {choice!r} makes the output a tool call; it cannot also follow "
                       "response_format", param="tool_choice")
    return ToolSpec(definitions, choice, function, True if parallel_tool_calls is None else parallel_tool_calls)
