"""${VAR} in compose.yaml, substituted into the parsed document: a value from the environment is data, never YAML.

The file is parsed first and the variables are substituted into its string values afterwards, as Compose does,
so no value can add a key, end a mapping or start a comment: a newline and an indent stay characters of the
string, and a token holding " #" or quotes is kept whole. Mapping keys are never substituted.

A newline is still refused where no program could take one (an image name, a port, a command-line argument,
a URL): only the values of `environment` (and x-ops `env`) may hold one, as an environment variable can.
The refusal names the variable, so the person knows which one to fix.
"""

import re

_VAR = re.compile(r"\$(?:\$|\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?)([-?])((?:[^{}]|\{[^{}]*\})*))?\}|([A-Za-z_][A-Za-z0-9_]*))")
_LINE_BREAK = re.compile(r"[\n\r\v\f\x85\u2028\u2029]")
_MULTILINE_PARENTS = {"environment", "env"}  # mappings (or KEY=value lists) of environment variables


class InterpolationError(Exception):
    """A variable that is required and unset, or whose value cannot go where the file puts it."""


def interpolate(text: str, env: dict[str, str], used: list[str] | None = None) -> str:
    """Compose's ${VAR}, ${VAR:-default}, ${VAR-default}, ${VAR:?error}, $VAR and $$ in one string. The names
    whose values were put in are appended to `used` (a default's own text comes from the file, not from them)."""

    def replace(m: re.Match) -> str:
        whole = m.group(0)
        if whole == "$$":
            return "$"
        name = m.group(1) or m.group(5)
        colon, op, arg = m.group(2), m.group(3), m.group(4)
        value = env.get(name)
        missing = value is None or (colon == ":" and value == "")
        if op == "-" and missing:
            return interpolate(arg, env, used)
        if op == "?" and missing:
            raise InterpolationError(f"compose.yaml needs ${{{name}}}: {arg or 'set it in the environment'}")
        if used is not None and value:
            used.append(name)
        return value or ""

    return _VAR.sub(replace, text)


def substitute(data, env: dict[str, str], where: str = "", multiline: bool = False):
    """A copy of parsed YAML with every string value interpolated; keys are left as written."""
    if isinstance(data, dict):
        return {k: substitute(v, env, f"{where}.{k}" if where else str(k), multiline or k in _MULTILINE_PARENTS)
                for k, v in data.items()}
    if isinstance(data, list):
        return [substitute(v, env, f"{where}[{i}]", multiline) for i, v in enumerate(data)]
    if not isinstance(data, str):
        return data
    used: list[str] = []
    text = interpolate(data, env, used)
    if not multiline:
        broken = [name for name in dict.fromkeys(used) if _LINE_BREAK.search(env[name])]
        if broken:
            raise InterpolationError(f"${broken[0]} holds a line break, which {where} cannot take; "
                                     f"set {broken[0]} to a single line")
    return text
