"""Reading and changing agent config files (JSON/JSONC, TOML, YAML), keeping what is not ours.

JSON files are edited as text (mcp_server.jsonc), so comments, trailing commas, layout and every
other key stay byte for byte; TOML and YAML go through tomlkit and ruamel, which keep comments.
"""

import io
import json
import shutil
import time
from pathlib import Path

from common.files import atomic_write_text
from mcp_server import jsonc
from mcp_server.client_entries import ENTRY, InstallError, Target


def read_text(t: Target) -> str:
    try:
        return t.path.read_text(encoding="utf-8") if t.path.exists() else ""
    except OSError as e:
        raise InstallError(f"cannot read {t.path}: {e.strerror}") from None


def load(t: Target, text: str):
    """The file's document: plain data for JSON, a tomlkit or ruamel document (comments kept) otherwise."""
    try:
        if t.format == "json":
            data = jsonc.loads(text)
        elif t.format == "toml":
            import tomlkit

            data = tomlkit.parse(text)
        else:
            from ruamel.yaml import YAML

            data = YAML().load(text) if text.strip() else None
            data = {} if data is None else data
    except Exception as e:  # each parser raises its own error types
        kind = "JSON (comments and trailing commas allowed)" if t.format == "json" else t.format.upper()
        raise InstallError(f"{t.path} is not valid {kind} ({str(e).splitlines()[0]}); fix or move it first, "
                           "nothing was changed") from None
    if not isinstance(data, dict):
        raise InstallError(f"{t.path} does not hold a mapping at its top level; nothing was changed")
    return data


def servers(t: Target, data) -> dict | None:
    """The mapping of servers (None when the file has none); refuses a file where it is something else."""
    node = data
    for key in t.key:
        node = node.get(key) if isinstance(node, dict) else None
        if node is None:
            return None
    if not isinstance(node, dict):
        raise InstallError(f"{t.path}: {'.'.join(t.key)} is not a mapping; nothing was changed")
    return node


def plain(value):
    """TOML/YAML documents' values as plain ones, for comparing."""
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [plain(v) for v in value]
    if hasattr(value, "unwrap"):
        return plain(value.unwrap())
    return value


def with_entry(t: Target, text: str, data, value: dict | None, inputs: list[dict]) -> str:
    """The file's new text with our entry set to `value` (None: removed) and our VS Code inputs kept in step."""
    if t.format == "json":
        text = jsonc.set_member(text, [*t.key, ENTRY], value) if value is not None else \
            jsonc.delete_member(text, [*t.key, ENTRY])
        for item in inputs:
            current = data.get("inputs") if isinstance(data.get("inputs"), list) else []
            index = next((i for i, x in enumerate(current) if isinstance(x, dict) and x.get("id") == item["id"]), None)
            if index is not None:
                text = jsonc.remove_item(text, ["inputs"], index)
            if value is not None:
                text = jsonc.append_item(text, ["inputs"], item)
        return text
    node = data
    for key in t.key:
        if node.get(key) is None:
            if value is None:
                return text
            node[key] = _table() if t.format == "toml" else {}
        node = node[key]
    if value is None:
        node.pop(ENTRY, None)
    else:
        node[ENTRY] = value
    return dump(t, data)


def _table():
    import tomlkit

    return tomlkit.table(is_super_table=True)


def dump(t: Target, data) -> str:
    if t.format == "toml":
        import tomlkit

        return tomlkit.dumps(data)
    from ruamel.yaml import YAML

    yaml = YAML()
    yaml.default_flow_style = False
    buffer = io.StringIO()
    yaml.dump(data, buffer)
    return buffer.getvalue()


def snippet(t: Target, value: dict, inputs: list[dict]) -> str:
    """What --print shows: the entry as it would stand in the file."""
    nested: dict = {ENTRY: value}
    for key in reversed(t.key):
        nested = {key: nested}
    if t.format == "json":
        return json.dumps({**({"inputs": inputs} if inputs else {}), **nested}, indent=2)
    return dump(t, nested)


def write(t: Target, text: str) -> Path | None:
    """Write atomically (same permissions), backing the old file up first; returns the backup's path."""
    backup = None
    mode = None
    try:
        if t.path.exists():
            backup = t.path.with_name(f"{t.path.name}.{time.strftime('%Y%m%d-%H%M%S')}.scriptorium.bak")
            shutil.copy2(t.path, backup)
            mode = t.path.stat().st_mode & 0o777
        atomic_write_text(t.path, text, mode)
    except OSError as e:
        raise InstallError(f"cannot write {t.path}: {e.strerror}") from None
    return backup
