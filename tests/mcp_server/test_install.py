"""Registration in every agent client, into a temporary HOME and project, parsed back from disk and compared
with each client's documented format (tests/mcp_server/client_formats.py); no token in any file."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import tomlkit
from ruamel.yaml import YAML

from common.agent_configs import remembered
from common.settings import DEFAULT_LLM_URL
from mcp_server import client_entries
from mcp_server.install import CLIENTS, InstallError, install, target, uninstall
from tests.backend.server_process import ROOT
from tests.mcp_server import client_formats
from tests.mcp_server.client_formats import TOKEN

# What each client's file holds before we touch it: someone else's server must survive.
OTHERS = {
    "json": {"mcpServers": {"github": {"command": "npx", "args": ["-y", "@modelcontextprotocol/server-github"]}},
             "theme": "dark"},
    "vscode": {"servers": {"github": {"type": "stdio", "command": "npx", "args": ["gh"]}}, "inputs": []},
    "toml": '# my settings\nmodel = "o4-mini"\n\n[mcp_servers.github]\ncommand = "npx"\nargs = ["gh"]\n',
    "hermes": "# Hermes\nmodel: hermes-4\nmcp_servers:\n  github:\n    command: npx\n    args: [gh]\n",
    "goose": "GOOSE_MODE: auto\nextensions:\n  developer:\n    type: builtin\n    name: developer\n    enabled: true\n",
}
JSONC = """{
  // my servers
  "servers": {
    /* GitHub's */
    "github": {"type": "stdio", "command": "npx", "args": ["gh"]}, // keep me
  },
  "inputs": [
    {"type": "promptString", "id": "gh-token", "password": true}, // theirs
  ],
}
"""


def seed(client: str, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if client == "vscode":
        path.write_text(json.dumps(OTHERS["vscode"]))
    elif client == "codex":
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
    from mcp_server import jsonc

    return jsonc.loads(text)


def servers_of(client: str, data: dict) -> dict:
    key = {"vscode": "servers", "codex": "mcp_servers", "hermes": "mcp_servers", "goose": "extensions"}
    return data[key.get(client, "mcpServers")]


def every_file(root: Path) -> str:
    return "".join(p.read_text(errors="replace") for p in root.rglob("*") if p.is_file())


@pytest.mark.parametrize("client", CLIENTS)
def test_stdio_install_merges_backs_up_is_idempotent_and_uninstalls(client, home):
    scope = "project" if client in ("claude-code", "cursor", "vscode", "codex") else "user"
    project = home / "project"
    path = target(client, scope, project).path
    seed(client, path)
    original = path.read_text()

    result = install(client, scope, project)
    assert result["changed"] and Path(result["backup"]).read_text() == original
    servers = servers_of(client, read(path))
    assert len(servers) == 2  # the other entry is still there
    if scope == "project":  # committed: no interpreter path of this machine, no settings snapshot
        assert servers["scriptorium"] == client_formats.stdio(client, "python", {})
        assert str(home) not in path.read_text()
        assert any("source " in n for n in result["notes"])
        assert f"export SCRIPTORIUM_HOME={home / 'data'}" in result["notes"]
    else:
        assert servers["scriptorium"] == client_formats.stdio(client, sys.executable, {
            "SCRIPTORIUM_HOME": str(home / "data"), "SCRIPTORIUM_LLM_URL": DEFAULT_LLM_URL})
    assert path in remembered(home / "data")  # ops backup learns which files install changed

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
def test_http_entries_follow_each_clients_format_and_hold_no_token(client, home):
    scope = "project" if client in ("claude-code", "cursor", "vscode") else "user"
    result = install(client, scope, home / "project", http_url=client_formats.URL, token_configured=True)
    data = read(Path(result["path"]))
    assert servers_of(client, data)["scriptorium"] == client_formats.HTTP[client]
    if client == "vscode":
        assert data["inputs"] == [client_formats.VSCODE_INPUT]
    assert TOKEN not in every_file(home)  # neither the file, its backup nor our record holds the token
    assert result["notes"]  # what to export (or add by hand)
    shown = install(client, scope, home / "project", http_url=client_formats.URL, token_configured=True,
                    dry_run=True)
    assert TOKEN not in shown["snippet"] and shown["notes"] == result["notes"]


def test_no_token_reference_for_a_local_server_without_one(home):
    result = install("claude-code", "project", home / "project", http_url="http://127.0.0.1:8765/mcp")
    assert servers_of("claude-code", read(Path(result["path"])))["scriptorium"] == \
        {"type": "http", "url": "http://127.0.0.1:8765/mcp"}


def test_jsonc_comments_and_trailing_commas_survive_install_and_uninstall(home):
    path = target("vscode", "project", home / "project").path
    path.parent.mkdir(parents=True)
    path.write_text(JSONC)
    install("vscode", "project", home / "project", http_url=client_formats.URL, token_configured=True)
    text = path.read_text()
    for kept in ("// my servers", "/* GitHub's */", "// keep me", "// theirs"):
        assert kept in text
    data = read(path)
    assert set(data["servers"]) == {"github", "scriptorium"}
    assert [i["id"] for i in data["inputs"]] == ["gh-token", "scriptorium-mcp-token"]
    uninstall("vscode", "project", home / "project")
    data = read(path)
    assert set(data["servers"]) == {"github"} and [i["id"] for i in data["inputs"]] == ["gh-token"]
    assert "// keep me" in path.read_text() and "// theirs" in path.read_text()


def test_windows_locations(home, monkeypatch):
    monkeypatch.setattr(client_entries.sys, "platform", "win32")
    monkeypatch.setenv("APPDATA", str(home / "AppData" / "Roaming"))
    monkeypatch.setenv("LOCALAPPDATA", str(home / "AppData" / "Local"))
    assert target("hermes", "user", home).path == home / "AppData" / "Local" / "hermes" / "config.yaml"
    assert target("goose", "user", home).path == \
        home / "AppData" / "Roaming" / "Block" / "goose" / "config" / "config.yaml"
    assert target("claude-desktop", "user", home).path == \
        home / "AppData" / "Roaming" / "Claude" / "claude_desktop_config.json"


def claude_cli() -> Path:
    """The real Claude Code CLI (`make test` installs it into .tools/ from the npm registry)."""
    for candidate in (ROOT / ".tools" / "npm" / "bin" / "claude", Path("/usr/local/bin/claude")):
        if candidate.exists():
            return candidate
    pytest.skip("the claude CLI is not installed: `make tools` installs it (needs npm)")


@pytest.mark.parametrize("scope", ["local", "user"])
def test_claude_code_goes_through_its_cli(home, monkeypatch, scope):
    cli = claude_cli()
    bin_dir = home / "bin"
    bin_dir.mkdir()
    (bin_dir / "claude").symlink_to(cli)
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")
    project = home / "project"
    result = install("claude-code", scope, project, http_url=client_formats.URL, token_configured=True)
    assert result["changed"]
    data = json.loads((home / "home" / ".claude.json").read_text())
    where = data["projects"][str(project.resolve())] if scope == "local" else data
    assert where["mcpServers"]["scriptorium"] == client_formats.HTTP["claude-code"]
    assert not install("claude-code", scope, project, http_url=client_formats.URL, token_configured=True)["changed"]
    stdio = install("claude-code", scope, project)  # a changed entry replaces ours
    assert stdio["changed"] and Path(stdio["backup"]).exists()
    data = json.loads((home / "home" / ".claude.json").read_text())
    where = data["projects"][str(project.resolve())] if scope == "local" else data
    assert where["mcpServers"]["scriptorium"]["command"] == sys.executable
    assert uninstall("claude-code", scope, project)["changed"]
    data = json.loads((home / "home" / ".claude.json").read_text())
    where = data["projects"][str(project.resolve())] if scope == "local" else data
    assert "scriptorium" not in where.get("mcpServers", {})
    assert TOKEN not in every_file(home / "home")


def test_a_file_that_does_not_parse_is_left_alone(home):
    path = target("cursor", "user", home).path
    path.parent.mkdir(parents=True)
    path.write_text('{"mcpServers": {oops')
    with pytest.raises(InstallError, match=f"{path} is not valid JSON"):
        install("cursor", "user", home)
    assert path.read_text() == '{"mcpServers": {oops'
    assert list(path.parent.iterdir()) == [path]


def test_scopes_each_client_has(home):
    with pytest.raises(InstallError, match="goose reads only its user configuration"):
        install("goose", "project", home)
    with pytest.raises(InstallError, match="--scope local is Claude Code's"):
        install("cursor", "local", home)
    with pytest.raises(InstallError, match="unknown client 'zed'"):
        install("zed", "user", home)


def test_cli_print_writes_nothing_and_install_reports_one_line(home):
    env = {**os.environ, "HOME": str(home / "home")}
    shown = subprocess.run([sys.executable, "-m", "mcp_server", "install", "--client", "cursor", "--http",
                            client_formats.URL, "--print"], capture_output=True, text=True, env=env, cwd=ROOT,
                           timeout=60)
    assert shown.returncode == 0, shown.stderr
    assert "${env:SCRIPTORIUM_MCP_TOKEN}" in shown.stdout and TOKEN not in shown.stdout
    assert "note: export SCRIPTORIUM_MCP_TOKEN=" in shown.stdout and not (home / "home" / ".cursor").exists()
    done = subprocess.run([sys.executable, "-m", "mcp_server", "install", "--client", "cursor"],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=60)
    assert done.returncode == 0 and "installed scriptorium in" in done.stdout
    bad = subprocess.run([sys.executable, "-m", "mcp_server", "install", "--client", "emacs"],
                         capture_output=True, text=True, env=env, cwd=ROOT, timeout=60)
    assert bad.returncode != 0 and "emacs" in bad.stderr


@pytest.mark.parametrize("client", CLIENTS)
def test_toolsets_go_into_the_stdio_entrys_args(client, home):
    path = install(client, "user", home / "project", toolsets=("core", "team"))["path"]
    got = servers_of(client, read(Path(path)))["scriptorium"]
    assert got["args"] == ["-m", "mcp_server", "--toolsets", "core,team"]
