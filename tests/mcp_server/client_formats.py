"""Each client's documented entry shapes, written down from its documentation (not from our code), for the
install tests to compare against. URL: what the HTTP entries point at; PYTHON: the installing interpreter."""

TOKEN = "tok-3f9a0c77e1d54b"  # the MCP token the install tests' environment holds
URL = "http://10.1.2.3:8765/mcp"  # not localhost: the entries must carry the token's reference

HTTP = {
    # Claude Code, "Connect Claude Code to tools via MCP": "type": "http", url, headers; ${VAR} is expanded
    # in command, args, env, url and headers.
    "claude-code": {"type": "http", "url": URL, "headers": {"Authorization": "Bearer ${SCRIPTORIUM_MCP_TOKEN}"}},
    # Cursor, "Model Context Protocol": remote servers take url and headers; interpolation is ${env:NAME}.
    "cursor": {"url": URL, "headers": {"Authorization": "Bearer ${env:SCRIPTORIUM_MCP_TOKEN}"}},
    # VS Code, "MCP configuration reference": "type": "http", url, headers; secrets through an `inputs`
    # entry of type promptString with password: true, referenced as ${input:ID}.
    "vscode": {"type": "http", "url": URL, "headers": {"Authorization": "Bearer ${input:scriptorium-mcp-token}"}},
    # Codex, config.toml [mcp_servers.NAME]: url and bearer_token_env_var (the variable holding the token);
    # startup_timeout_sec, how long Codex waits for the server to start (default 10).
    "codex": {"url": URL, "bearer_token_env_var": "SCRIPTORIUM_MCP_TOKEN", "startup_timeout_sec": 30},
    # Hermes Agent, config.yaml mcp_servers: url, headers (${VAR} interpolated), timeout.
    "hermes": {"url": URL, "headers": {"Authorization": "Bearer ${SCRIPTORIUM_MCP_TOKEN}"}, "timeout": 300},
    # Goose, config.yaml extensions: type streamable_http, uri, headers, env_keys naming secrets it supplies.
    "goose": {"type": "streamable_http", "name": "scriptorium", "enabled": True, "uri": URL,
              "headers": {"Authorization": "Bearer $SCRIPTORIUM_MCP_TOKEN"}, "envs": {},
              "env_keys": ["SCRIPTORIUM_MCP_TOKEN"], "timeout": 300},
    # Claude Desktop runs stdio servers only; mcp-remote's README: the header from an env variable written
    # "Authorization:${AUTH_HEADER}" (no spaces in args), --allow-http for plain http beyond localhost.
    "claude-desktop": {"command": "npx", "args": ["-y", "mcp-remote", URL, "--allow-http", "--header",
                                                  "Authorization:${AUTH_HEADER}"]},
}

VSCODE_INPUT = {"type": "promptString", "id": "scriptorium-mcp-token", "password": True,
                "description": "Scriptorium MCP token (the server's SCRIPTORIUM_MCP_TOKEN)"}


def stdio(client: str, command: str, env: dict) -> dict:
    """The stdio entry: command, args, env, in each client's keys."""
    args = ["-m", "mcp_server"]
    if client == "goose":  # Goose: type stdio, cmd, args, envs, env_keys, timeout
        return {"type": "stdio", "name": "scriptorium", "enabled": True, "cmd": command, "args": args, "envs": env,
                "env_keys": [], "timeout": 300}
    if client == "codex":  # Codex: command, args, env (a table, left out when empty), startup_timeout_sec
        return {"command": command, "args": args, **({"env": env} if env else {}), "startup_timeout_sec": 30}
    entry = {"command": command, "args": args, "env": env}
    if client in ("claude-code", "vscode"):
        entry = {"type": "stdio", **entry}
    if client == "hermes":
        entry["timeout"] = 300
    return entry
