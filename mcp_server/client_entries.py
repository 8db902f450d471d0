"""Where each agent client keeps its MCP servers, and our entry in the shape that client documents.

No entry ever holds a secret: each client's own reference to the token stands in for it, and the
notes returned with an entry say what the user must export (or, for Claude Desktop, add by hand).
Project-scope entries are meant to be committed, so they hold no absolute path and no settings; the others carry
what a server started from any directory needs to find this stack (stack_env).
"""

import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlparse

from common.settings import Settings, SettingsError

ENTRY = "scriptorium"
CLIENTS = ("claude-desktop", "claude-code", "cursor", "vscode", "codex", "hermes", "goose")
SCOPES = ("user", "project", "local")
PASSED_ENV = ("SCRIPTORIUM_HOME", "SCRIPTORIUM_CONFIG", "SCRIPTORIUM_LLM_URL", "SCRIPTORIUM_COMFYUI_URL",
              "SCRIPTORIUM_LLM_MODEL")
TOKEN_VAR = "SCRIPTORIUM_MCP_TOKEN"
VSCODE_INPUT = "scriptorium-mcp-token"
LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1")
# Codex gives a server 10 s to start by default; a cold start on a busy machine (Python, the SDK) can take longer.
CODEX_STARTUP = {"startup_timeout_sec": 30}


class InstallError(Exception):
    pass


@dataclass
class Target:
    client: str
    scope: str
    path: Path
    format: str  # json (read and written as JSONC) | toml | yaml
    key: list[str]  # the path of the servers mapping inside the file


@dataclass
class Entry:
    value: dict
    inputs: list[dict] = field(default_factory=list)  # VS Code: top-level `inputs` the entry refers to
    notes: list[str] = field(default_factory=list)  # what the user must do for it to work


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
    if scope not in SCOPES:
        raise InstallError(f"scope must be one of {', '.join(SCOPES)}, got {scope!r}")
    if scope == "local" and client != "claude-code":
        raise InstallError(f"--scope local is Claude Code's (this project, only you); {client} has user"
                           + (" and project" if client in ("cursor", "vscode", "codex") else "") + " scope")
    if scope == "project" and client in ("claude-desktop", "hermes", "goose"):
        raise InstallError(f"{client} reads only its user configuration; use --scope user")
    project = project.resolve()
    if client == "claude-desktop":
        return Target(client, scope, _app_support("Claude") / "claude_desktop_config.json", "json", ["mcpServers"])
    if client == "claude-code":  # docs: .mcp.json (project); ~/.claude.json (user; local under projects.<dir>)
        if scope == "project":
            return Target(client, scope, project / ".mcp.json", "json", ["mcpServers"])
        key = ["projects", str(project), "mcpServers"] if scope == "local" else ["mcpServers"]
        return Target(client, scope, Path.home() / ".claude.json", "json", key)
    if client == "cursor":
        base = project if scope == "project" else Path.home()
        return Target(client, scope, base / ".cursor" / "mcp.json", "json", ["mcpServers"])
    if client == "vscode":
        path = project / ".vscode" / "mcp.json" if scope == "project" else _app_support("Code") / "User" / "mcp.json"
        return Target(client, scope, path, "json", ["servers"])
    if client == "codex":
        base = project / ".codex" if scope == "project" else Path(os.environ.get("CODEX_HOME") or Path.home() / ".codex")
        return Target(client, scope, base / "config.toml", "toml", ["mcp_servers"])
    if client == "hermes":
        default = Path(os.environ["LOCALAPPDATA"]) / "hermes" if sys.platform == "win32" else Path.home() / ".hermes"
        home = Path(os.environ.get("HERMES_HOME") or default)
        return Target(client, scope, home / "config.yaml", "yaml", ["mcp_servers"])
    if sys.platform == "win32":  # Goose's documented Windows location
        path = Path(os.environ["APPDATA"]) / "Block" / "goose" / "config" / "config.yaml"
    else:
        path = _config_home() / "goose" / "config.yaml"
    return Target(client, scope, path, "yaml", ["extensions"])


def stack_env() -> dict[str, str]:
    """The settings of this stack as they are here, for a server an agent starts in any directory: the data
    directory (and the config file, when one is named) as absolute paths, the LLM's URL wherever it was set (the
    environment, the config file or the default), ComfyUI's URL and the model when the environment sets them.
    Never a secret: the MCP token and the LLM's API key stay in the environment or the config file."""
    try:
        settings = Settings.from_env()
    except SettingsError as e:
        raise InstallError(str(e)) from None
    env = {"SCRIPTORIUM_HOME": str(settings.home.resolve()), "SCRIPTORIUM_LLM_URL": ",".join(settings.llm_urls)}
    if os.environ.get("SCRIPTORIUM_CONFIG"):
        env["SCRIPTORIUM_CONFIG"] = str(Path(os.environ["SCRIPTORIUM_CONFIG"]).expanduser().resolve())
    env.update({k: os.environ[k] for k in ("SCRIPTORIUM_COMFYUI_URL", "SCRIPTORIUM_LLM_MODEL") if os.environ.get(k)})
    return env


def needs_token(http_url: str, token_configured: bool) -> bool:
    """Send a token when the server has one here, or when it is not on this machine (it must have one)."""
    return token_configured or (urlparse(http_url).hostname or "") not in LOCAL_HOSTS


def entry(client: str, scope: str, http_url: str | None, token_configured: bool = False,
          toolsets: tuple[str, ...] | None = None) -> Entry:
    """Our entry in the shape `client` documents: stdio (this interpreter) or streamable HTTP at http_url.
    toolsets: what the stdio server lists (None: its default)."""
    if http_url is None:
        return _stdio(client, scope, toolsets)
    if toolsets is not None:
        raise InstallError("--toolsets is for stdio entries: the HTTP server lists the toolsets it was started with "
                           "(SCRIPTORIUM_MCP_TOOLSETS or --toolsets where it runs)")
    return _http(client, http_url, needs_token(http_url, token_configured))


def _stdio(client: str, scope: str, toolsets: tuple[str, ...] | None) -> Entry:
    notes = []
    if scope == "project":  # committed: whoever checks it out runs their own interpreter with their own settings
        command, env = "python", {}
        notes.append(f"the entry runs `python -m mcp_server`: start {client} with Scriptorium's environment active "
                     f"(e.g. `source {Path(sys.prefix) / 'bin' / 'activate'}`)")
        notes += [f"export {k}={os.environ[k]}" for k in PASSED_ENV if os.environ.get(k)]
    else:
        command, env = sys.executable, stack_env()
    args = ["-m", "mcp_server", *(["--toolsets", ",".join(toolsets)] if toolsets else [])]
    if client == "goose":  # Goose config.yaml extension: type stdio, cmd, args, envs, env_keys
        return Entry({"type": "stdio", "name": ENTRY, "enabled": True, "cmd": command, "args": args, "envs": env,
                      "env_keys": [], "timeout": 300}, notes=notes)
    if client == "codex":  # Codex config.toml [mcp_servers.NAME]: command, args, env, startup_timeout_sec
        return Entry({"command": command, "args": args, **({"env": env} if env else {}), **CODEX_STARTUP},
                     notes=notes)
    value = {"command": command, "args": args, "env": env}
    if client in ("claude-code", "vscode"):  # both document "type": "stdio"
        value = {"type": "stdio", **value}
    if client == "hermes":  # Hermes mcp_servers: command, args, env, timeout
        value["timeout"] = 300
    return Entry(value, notes=notes)


def _http(client: str, url: str, auth: bool) -> Entry:
    export = [f"export {TOKEN_VAR}=<the server's token> in the environment {client} starts from"] if auth else []
    if client == "codex":  # Codex: url + bearer_token_env_var (it reads the variable itself)
        return Entry({"url": url, **({"bearer_token_env_var": TOKEN_VAR} if auth else {}), **CODEX_STARTUP},
                     notes=export)
    if client == "claude-desktop":
        # Claude Desktop starts only stdio servers: mcp-remote bridges (its README's format: the header from an
        # env variable, "Authorization:${AUTH_HEADER}" without spaces, --allow-http for plain http elsewhere).
        args = ["-y", "mcp-remote", url]
        if urlparse(url).scheme == "http" and urlparse(url).hostname not in LOCAL_HOSTS:
            args.append("--allow-http")
        notes = ["needs Node.js (npx) for mcp-remote"]
        if auth:
            args += ["--header", "Authorization:${AUTH_HEADER}"]
            notes.append('Claude Desktop has no secret reference, so install writes no token: add "env": '
                         '{"AUTH_HEADER": "Bearer <the server\'s token>"} to the scriptorium entry yourself')
        return Entry({"command": "npx", "args": args}, notes=notes)
    if client == "vscode":  # VS Code mcp.json: a promptString input (password) referenced as ${input:ID}
        headers = {"Authorization": f"Bearer ${{input:{VSCODE_INPUT}}}"} if auth else {}
        inputs = [{"type": "promptString", "id": VSCODE_INPUT, "password": True,
                   "description": "Scriptorium MCP token (the server's SCRIPTORIUM_MCP_TOKEN)"}] if auth else []
        notes = ["VS Code asks for the token when it first starts the server and keeps it in its secret storage"]
        return Entry({"type": "http", "url": url, **({"headers": headers} if auth else {})}, inputs,
                     notes if auth else [])
    if client == "goose":  # Goose: streamable_http with uri and headers; env_keys names the secret Goose supplies
        headers = {"Authorization": f"Bearer ${TOKEN_VAR}"} if auth else {}
        return Entry({"type": "streamable_http", "name": ENTRY, "enabled": True, "uri": url, "headers": headers,
                      "envs": {}, "env_keys": [TOKEN_VAR] if auth else [], "timeout": 300},
                     notes=[f"Goose reads {TOKEN_VAR} from the environment or its keyring"] if auth else [])
    reference = {"cursor": f"${{env:{TOKEN_VAR}}}"}.get(client, f"${{{TOKEN_VAR}}}")  # Cursor: ${env:NAME}
    value = {"url": url, **({"headers": {"Authorization": f"Bearer {reference}"}} if auth else {})}
    if client == "claude-code":  # Claude Code: "type": "http", ${VAR} expanded in url and headers
        value = {"type": "http", **value}
    if client == "hermes":  # Hermes mcp_servers: url, headers (${VAR} expanded), timeout
        value["timeout"] = 300
    return Entry(value, notes=export)
