"""The shape of the answers the stdio front remembers: the JSON-RPC results the SDK server gives to `initialize`,
`tools/list` and `prompts/list`, checked field by field before one is sent to a client. A file whose tag checks
out was still written by code that may have had a bug, and the front must never crash on what it reads."""

CAPABILITIES_THAT_LIST = ("tools", "prompts", "resources")  # those whose listChanged is a boolean


def problem(answers: object) -> str | None:
    """What makes answers ({method: {protocol version: result}}) unfit to send to a client, or None."""
    if not isinstance(answers, dict):
        return "not a JSON object"
    for method, by_version in answers.items():
        check = _CHECKS.get(method)
        if check is None:
            return f"an answer to {method!r}, which is never remembered"
        if not isinstance(by_version, dict) or not by_version:
            return f"{method}: not an object of protocol versions"
        for wanted, result in by_version.items():
            found = check(result, wanted) if isinstance(result, dict) else "not a JSON object"
            if found:
                return f"{method} ({wanted}): {found}"
    initialized = answers.get("initialize", {})
    for method, by_version in answers.items():
        if missing := [wanted for wanted in by_version if wanted not in initialized]:
            return f"{method} ({missing[0]}): no initialize answer for that protocol version"
    return None


def _initialize(result: dict, wanted: str) -> str | None:
    if result.get("protocolVersion") != wanted:
        return "its protocolVersion is not the one it is kept under"
    capabilities = result.get("capabilities")
    if not isinstance(capabilities, dict) or not all(isinstance(c, dict) for c in capabilities.values()):
        return "capabilities is not an object of objects"
    for name in CAPABILITIES_THAT_LIST:
        if not isinstance(capabilities.get(name, {}).get("listChanged", False), bool):
            return f"capabilities.{name}.listChanged is not a boolean"
    info = result.get("serverInfo")
    if not isinstance(info, dict) or not _text(info.get("name")) or not isinstance(info.get("version"), str):
        return "serverInfo has no name and version"
    return _optional(result, instructions=str)


def _tools(result: dict, _wanted: str) -> str | None:
    return _listed(result, "tools", _tool)


def _tool(tool: dict) -> str | None:
    schema = tool.get("inputSchema")
    if not isinstance(schema, dict) or schema.get("type") != "object":
        return "its inputSchema is not an object schema"
    return _optional(tool, title=str, description=str, outputSchema=dict, annotations=dict)


def _prompts(result: dict, _wanted: str) -> str | None:
    return _listed(result, "prompts", _prompt)


def _prompt(prompt: dict) -> str | None:
    arguments = prompt.get("arguments", [])
    if not isinstance(arguments, list) or not all(
        isinstance(a, dict) and _text(a.get("name")) for a in arguments
    ):
        return "its arguments are not a list of named objects"
    if not all(isinstance(a.get("required", False), bool) for a in arguments):
        return "an argument's required is not a boolean"
    return _optional(prompt, title=str, description=str)


def _listed(result: dict, key: str, check) -> str | None:
    """A whole list (one page, no nextCursor) of uniquely named objects, each passing check."""
    items = result.get(key)
    if not isinstance(items, list):
        return f"{key} is not a list"
    if "nextCursor" in result:
        return "only the first page of a longer list"
    names: set[str] = set()
    for item in items:
        if not isinstance(item, dict) or not _text(item.get("name")):
            return f"one of the {key} has no name"
        if item["name"] in names:
            return f"{item['name']!r} is listed twice"
        names.add(item["name"])
        if found := check(item):
            return f"{item['name']!r}: {found}"
    return None


def _optional(value: dict, **types: type) -> str | None:
    for name, kind in types.items():
        if name in value and not isinstance(value[name], kind):
            return f"{name} is not a {'string' if kind is str else 'JSON object'}"
    return None


def _text(value: object) -> bool:
    return isinstance(value, str) and bool(value)


_CHECKS = {"initialize": _initialize, "tools/list": _tools, "prompts/list": _prompts}
