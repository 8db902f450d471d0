"""${VAR} in compose.yaml, substituted into the parsed document: a value from the environment is data, never YAML.

The file is parsed first and the variables are substituted into its string values afterwards, as Compose does,
so no value can add a key, end a mapping or start a comment: a newline and an indent stay characters of the
string, and a token holding " #" or quotes is kept whole. Mapping keys are never substituted.

A newline is still refused where no program could take one (an image name, a port, a command-line argument,
a URL): only the values of `environment` (and x-ops `env`) may hold one, as an environment variable can.
The refusal names the variable, so the person knows which one to fix.

ops' own placeholders in x-ops commands ({python}, {port}, {home}) are filled in the same pass as the variables:
a value that holds "{home}" keeps those characters, and a placeholder's value is never read for $VAR.
"""

import re

_VAR = re.compile(r"\$(?:\$|\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?)([-?])((?:[^{}]|\{[^{}]*\})*))?\}|([A-Za-z_][A-Za-z0-9_]*))")
_VAR_OR_PLACEHOLDER = re.compile(_VAR.pattern + r"|\{([a-z]+)\}")
_LINE_BREAK = re.compile(r"[\n\r\v\f\x85\u2028\u2029]")
_MULTILINE_PARENTS = {"environment", "env"}  # mappings (or KEY=value lists) of environment variables


class InterpolationError(Exception):
    """A variable that is required and unset, or whose value cannot go where the file puts it."""


def interpolate(text: str, env: dict[str, str], used: list[str] | None = None,
                placeholders: dict[str, str] | None = None) -> str:
    """Compose's ${VAR}, ${VAR:-default}, ${VAR-default}, ${VAR:?error}, $VAR and $$ in one string, and with
    `placeholders` their {name}s (others are left as written). The names whose values were put in are appended
    to `used` (a default's own text comes from the file, not from them)."""

    def replace(m: re.Match) -> str:
        whole = m.group(0)
        if placeholders is not None and m.group(6) is not None:
            return placeholders.get(m.group(6), whole)
        if whole == "$$":
            return "$"
        name = m.group(1) or m.group(5)
        colon, op, arg = m.group(2), m.group(3), m.group(4)
        value = env.get(name)
        missing = value is None or (colon == ":" and value == "")
        if op == "-" and missing:
            return interpolate(arg, env, used, placeholders)
        if op == "?" and missing:
            raise InterpolationError(f"${{{name}}} must be set: {arg or 'set it in the environment'}")
        if used is not None and value:
            used.append(name)
        return value or ""

    return (_VAR if placeholders is None else _VAR_OR_PLACEHOLDER).sub(replace, text)


def substitute(data, env: dict[str, str], where: str = "", multiline: bool = False,
               placeholders: dict[str, str] | None = None):
    """A copy of parsed YAML with every string value interpolated; keys are left as written."""
    if isinstance(data, dict):
        return {k: substitute(v, env, f"{where}.{k}" if where else str(k), multiline or k in _MULTILINE_PARENTS,
                              placeholders) for k, v in data.items()}
    if isinstance(data, list):
        return [substitute(v, env, f"{where}[{i}]", multiline, placeholders) for i, v in enumerate(data)]
    if not isinstance(data, str):
        return data
    used: list[str] = []
    text = interpolate(data, env, used, placeholders)
    if not multiline:
        broken = [name for name in dict.fromkeys(used) if _LINE_BREAK.search(env[name])]
        if broken:
            raise InterpolationError(f"${broken[0]} holds a line break, which {where} cannot take; "
                                     f"set {broken[0]} to a single line")
    return text
