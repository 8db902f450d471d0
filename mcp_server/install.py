"""`python -m mcp_server install|uninstall --client NAME`: our entry in an agent's MCP configuration.

Each client reads its own file and shape. Changes merge into the file without touching other
entries, keep a timestamped backup of the previous file, do nothing when the entry is already
there, and refuse to touch a file that does not parse.
"""

import json
import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ENTRY = "scriptorium"
CLIENTS = ("claude-desktop", "claude-code", "cursor", "vscode", "codex", "hermes", "goose")
PASSED_ENV = ("SCRIPTORIUM_HOME", "SCRIPTORIUM_LLM_URL", "SCRIPTORIUM_COMFYUI_URL", "SCRIPTORIUM_LLM_MODEL")


class InstallError(Exception):
    pass


@dataclass
class Target:
    client: str
    path: Path
    format: str  # json | toml | yaml
    key: str  # the mapping of servers inside the file


def _config_home() -> Path:
    return Path(os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config")


def _app_support(name: str) -> Path:
    """The per-user application folder of desktop apps (Claude Desktop, VS Code)."""
    if sys.platform == "darwin":
        return Path.home() / "Library" / "Application Support" / name
    if sys.platform == "win32":
        return Path(os.environ["APPDATA"]) / name
    return _config_home() / name


def target(client: str, scope: str, project: Path) -> Target:
    if client not in CLIENTS:
        raise InstallError(f"unknown client {client!r}; choose one of {', '.join(CLIENTS)}")
    if scope not in ("user", "project"):
        raise InstallError(f"scope must be user or project, got {scope!r}")
    user_only = {"claude-desktop", "hermes", "goose"}
    if scope == "project" and client in user_only:
        raise InstallError(f"{client} reads only its user configuration; use --scope user")
    project = project.resolve()
    if client == "claude-desktop":
        return Target(client, _app_support("Claude") / "claude_desktop_config.json", "json", "mcpServers")
    if client == "claude-code":
        path = project / ".mcp.json" if scope == "project" else Path.home() / ".claude.json"
        return Target(client, path, "json", "mcpServers")
    if client == "cursor":
        base = project if scope == "project" else Path.home()
        return Target(client, base / ".cursor" / "mcp.json", "json", "mcpServers")
    if client == "vscode":
        path = project / ".vscode" / "mcp.json" if scope == "project" else _app_support("Code") / "User" / "mcp.json"
        return Target(client, path, "json", "servers")
    if client == "codex":
        base = project / ".codex" if scope == "project" else Path(os.environ.get("CODEX_HOME") or Path.home() / ".codex")
        return Target(client, base / "config.toml", "toml", "mcp_servers")
    if client == "hermes":
        home = Path(os.environ.get("HERMES_HOME") or Path.home() / ".hermes")
        return Target(client, home / "config.yaml", "yaml", "mcp_servers")
    return Target(client, _config_home() / "goose" / "config.yaml", "yaml", "extensions")


def entry(client: str, http_url: str | None, token: str | None) -> dict:
    """Our server's entry in the shape `client` reads: stdio (this interpreter) or HTTP."""
    if http_url is None:
        command, args = sys.executable, ["-m", "mcp_server"]
        env = {k: os.environ[k] for k in PASSED_ENV if os.environ.get(k)}
        if client == "goose":
            return {"type": "stdio", "name": ENTRY, "enabled": True, "cmd": command, "args": args, "envs": env,
                    "env_keys": [], "timeout": 300}
        stdio = {"command": command, "args": args, "env": env}
        if client in ("claude-code", "vscode"):
            stdio = {"type": "stdio", **stdio}
        if client == "hermes":
            stdio["timeout"] = 300
        return stdio
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    if client == "codex":
        http = {"url": http_url}
        if token:
            http["bearer_token_env_var"] = "SCRIPTORIUM_MCP_TOKEN"  # Codex reads the token from the environment
        return http
    if client == "goose":
        return {"type": "streamable_http", "name": ENTRY, "enabled": True, "uri": http_url, "headers": headers,
                "envs": {}, "env_keys": [], "timeout": 300}
    if client == "claude-desktop":  # reads only stdio servers: bridge with mcp-remote (needs Node.js)
        args = ["-y", "mcp-remote", http_url] + (["--header", f"Authorization: Bearer {token}"] if token else [])
        return {"command": "npx", "args": args}
    http = {"url": http_url, "headers": headers}
    if client in ("claude-code", "vscode"):
        http = {"type": "http", **http}
    return http


# Reading and writing each format, keeping what is not ours ---------------------------------------------

def _load(t: Target):
    text = t.path.read_text() if t.path.exists() else ""
    try:
        if t.format == "json":
            return json.loads(text) if text.strip() else {}
        if t.format == "toml":
            import tomlkit

            return tomlkit.parse(text)
        from ruamel.yaml import YAML

        data = YAML().load(text) if text.strip() else None
        return data if data is not None else {}
    except Exception as e:  # each parser raises its own error types
        raise InstallError(f"{t.path} is not valid {t.format.upper()} ({str(e).splitlines()[0]}); fix or move it "
                           "first, nothing was changed") from None


def _dump(t: Target, data) -> str:
    if t.format == "json":
        return json.dumps(data, indent=2) + "\n"
    if t.format == "toml":
        import tomlkit

        return tomlkit.dumps(data)
    import io

    from ruamel.yaml import YAML

    yaml = YAML()
    yaml.default_flow_style = False
    buffer = io.StringIO()
    yaml.dump(data, buffer)
    return buffer.getvalue()


def _servers(t: Target, data, create: bool):
    if not isinstance(data, dict):
        raise InstallError(f"{t.path} does not hold a mapping at its top level; nothing was changed")
    servers = data.get(t.key)
    if servers is None and create:
        if t.format == "toml":
            import tomlkit

            servers = tomlkit.table(is_super_table=True)
        else:
            servers = {}
        data[t.key] = servers
    if servers is not None and not isinstance(servers, dict):
        raise InstallError(f"{t.path}: {t.key} is not a mapping; nothing was changed")
    return servers


def _plain(value):
    """Compare TOML/YAML documents' values with plain ones."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if hasattr(value, "unwrap"):
        return _plain(value.unwrap())
    return value


def _write(t: Target, text: str) -> Path | None:
    """Write atomically, backing the old file up first; returns the backup's path."""
    backup = None
    if t.path.exists():
        backup = t.path.with_name(f"{t.path.name}.{time.strftime('%Y%m%d-%H%M%S')}.scriptorium.bak")
        shutil.copy2(t.path, backup)
    t.path.parent.mkdir(parents=True, exist_ok=True)
    tmp = t.path.with_name(t.path.name + ".scriptorium.tmp")
    tmp.write_text(text)
    if t.path.exists():
        shutil.copymode(t.path, tmp)
    tmp.replace(t.path)
    return backup


def install(client: str, scope: str = "user", project: Path = Path("."), http_url: str | None = None,
            token: str | None = None, dry_run: bool = False) -> dict:
    t = target(client, scope, project)
    ours = entry(client, http_url, token)
    if dry_run:
        snippet = {t.key: {ENTRY: ours}}
        if t.format == "toml":
            import tomlkit

            text = tomlkit.dumps({t.key: {ENTRY: ours}})
        elif t.format == "yaml":
            text = _dump(t, snippet)
        else:
            text = json.dumps(snippet, indent=2)
        return {"client": client, "path": str(t.path), "changed": False, "snippet": text}
    data = _load(t)
    servers = _servers(t, data, create=True)
    if ENTRY in servers and _plain(servers[ENTRY]) == ours:
        return {"client": client, "path": str(t.path), "changed": False, "backup": None}
    servers[ENTRY] = ours
    backup = _write(t, _dump(t, data))
    return {"client": client, "path": str(t.path), "changed": True, "backup": str(backup) if backup else None}


def uninstall(client: str, scope: str = "user", project: Path = Path(".")) -> dict:
    t = target(client, scope, project)
    if not t.path.exists():
        return {"client": client, "path": str(t.path), "changed": False, "backup": None}
    data = _load(t)
    servers = _servers(t, data, create=False)
    if not servers or ENTRY not in servers:
        return {"client": client, "path": str(t.path), "changed": False, "backup": None}
    del servers[ENTRY]
    backup = _write(t, _dump(t, data))
    return {"client": client, "path": str(t.path), "changed": True, "backup": str(backup)}
