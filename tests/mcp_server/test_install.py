"""Registration in every agent client, into a temporary HOME and project, parsed back from disk."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import tomlkit
from ruamel.yaml import YAML

from mcp_server.install import CLIENTS, InstallError, install, target, uninstall
from tests.backend.server_process import ROOT

# What each client's file holds before we touch it: someone else's server must survive.
OTHERS = {
    "json": {"mcpServers": {"github": {"command": "npx", "args": ["-y", "@modelcontextprotocol/server-github"]}},
             "theme": "dark"},
    "vscode": {"servers": {"github": {"type": "stdio", "command": "npx", "args": ["gh"]}}, "inputs": []},
    "toml": '# my settings\nmodel = "o4-mini"\n\n[mcp_servers.github]\ncommand = "npx"\nargs = ["gh"]\n',
    "hermes": "# Hermes\nmodel: hermes-4\nmcp_servers:\n  github:\n    command: npx\n    args: [gh]\n",
    "goose": "GOOSE_MODE: auto\nextensions:\n  developer:\n    type: builtin\n    name: developer\n    enabled: true\n",
}


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    for var in ("XDG_CONFIG_HOME", "CODEX_HOME", "HERMES_HOME"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("SCRIPTORIUM_HOME", str(tmp_path / "data"))
    (tmp_path / "home").mkdir()
    (tmp_path / "project").mkdir()
    return tmp_path


def seed(client: str, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if client == "vscode":
        path.write_text(json.dumps(OTHERS["vscode"]))
    elif client in ("codex",):
        path.write_text(OTHERS["toml"])
    elif client in ("hermes", "goose"):
        path.write_text(OTHERS[client])
    else:
        path.write_text(json.dumps(OTHERS["json"]))


def read(path: Path):
    text = path.read_text()
    if path.suffix == ".toml":
        return tomlkit.parse(text).unwrap()
    if path.suffix == ".yaml":
        return YAML(typ="safe").load(text)
    return json.loads(text)


def servers_of(client: str, data: dict) -> dict:
    key = {"vscode": "servers", "codex": "mcp_servers", "hermes": "mcp_servers", "goose": "extensions"}
    return data[key.get(client, "mcpServers")]


@pytest.mark.parametrize("client", CLIENTS)
def test_install_merges_backs_up_is_idempotent_and_uninstalls(client, home):
    scope = "project" if client in ("claude-code", "cursor", "vscode", "codex") else "user"
    project = home / "project"
    path = target(client, scope, project).path
    seed(client, path)
    original = path.read_text()

    result = install(client, scope, project)
    assert result["changed"] and Path(result["backup"]).read_text() == original
    servers = servers_of(client, read(path))
    assert "scriptorium" in servers and len(servers) == 2  # the other entry is still there
    ours = servers["scriptorium"]
    command = ours.get("cmd") or ours.get("command")
    assert command == sys.executable and ours["args"] == ["-m", "mcp_server"]
    env = ours.get("envs") if client == "goose" else ours.get("env")
    assert env["SCRIPTORIUM_HOME"] == str(home / "data")
    if client in ("claude-code", "vscode"):
        assert ours["type"] == "stdio"

    before = sorted(path.parent.iterdir())
    again = install(client, scope, project)
    assert not again["changed"] and sorted(path.parent.iterdir()) == before  # no rewrite, no new backup

    removed = uninstall(client, scope, project)
    assert removed["changed"]
    remaining = servers_of(client, read(path))
    assert "scriptorium" not in remaining and len(remaining) == 1
    if client == "codex":
        assert "# my settings" in path.read_text()  # comments survive a round trip
    assert not uninstall(client, scope, project)["changed"]


@pytest.mark.parametrize("client", CLIENTS)
def test_http_entries(client, home):
    result = install(client, "user", home / "project", http_url="http://127.0.0.1:8765/mcp", token="s3cret")
    ours = servers_of(client, read(Path(result["path"])))["scriptorium"]
    flat = json.dumps(ours)
    if client == "claude-desktop":
        assert ours["command"] == "npx" and "http://127.0.0.1:8765/mcp" in ours["args"]
    elif client == "codex":
        assert ours == {"url": "http://127.0.0.1:8765/mcp", "bearer_token_env_var": "SCRIPTORIUM_MCP_TOKEN"}
    else:
        assert "http://127.0.0.1:8765/mcp" in flat and "Bearer s3cret" in flat
    if client == "goose":
        assert ours["type"] == "streamable_http"
    if client in ("claude-code", "vscode"):
        assert ours["type"] == "http"


def test_a_file_that_does_not_parse_is_left_alone(home):
    path = target("cursor", "user", home).path
    path.parent.mkdir(parents=True)
    path.write_text('{"mcpServers": {oops')
    with pytest.raises(InstallError, match=f"{path} is not valid JSON"):
        install("cursor", "user", home)
    assert path.read_text() == '{"mcpServers": {oops'
    assert list(path.parent.iterdir()) == [path]


def test_user_only_clients_refuse_project_scope(home):
    with pytest.raises(InstallError, match="goose reads only its user configuration"):
        install("goose", "project", home)
    with pytest.raises(InstallError, match="unknown client 'zed'"):
        install("zed", "user", home)


def test_cli_print_writes_nothing_and_install_reports_one_line(home):
    env = {**os.environ, "HOME": str(home / "home")}
    shown = subprocess.run([sys.executable, "-m", "mcp_server", "install", "--client", "codex", "--print"],
                           capture_output=True, text=True, env=env, cwd=ROOT, timeout=60)
    assert shown.returncode == 0, shown.stderr
    assert "[mcp_servers.scriptorium]" in shown.stdout and not (home / "home" / ".codex").exists()
    done = subprocess.run([sys.executable, "-m", "mcp_server", "install", "--client", "cursor"],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=60)
    assert done.returncode == 0 and "installed scriptorium in" in done.stdout
    bad = subprocess.run([sys.executable, "-m", "mcp_server", "install", "--client", "emacs"],
                         capture_output=True, text=True, env=env, cwd=ROOT, timeout=60)
    assert bad.returncode != 0 and "emacs" in bad.stderr
