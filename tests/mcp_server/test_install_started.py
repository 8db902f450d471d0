"""Installed entries as an agent starts them: the server an entry runs has the entry's toolsets, and a user-scope
entry finds the stack it was installed from when started from another directory without its variables."""

import os
import subprocess
import sys

import pytest

from mcp_server.install import InstallError, install
from tests.backend.server_process import ROOT
from tests.mcp_server import client_formats
from tests.mcp_server.client_formats import TOKEN
from tests.mcp_server.test_install import read


def test_the_installed_entry_starts_a_server_with_its_toolsets(home):
    import asyncio

    from mcp import Client, StdioServerParameters

    env = {**os.environ, "HOME": str(home / "home")}
    done = subprocess.run([sys.executable, "-m", "mcp_server", "install", "--client", "cursor", "--toolsets",
                           "images"], capture_output=True, text=True, env=env, cwd=ROOT, timeout=60)
    assert done.returncode == 0, done.stderr
    entry = read(home / "home" / ".cursor" / "mcp.json")["mcpServers"]["scriptorium"]
    params = StdioServerParameters(command=entry["command"], args=entry["args"], cwd=str(ROOT),
                                   env={**env, **entry["env"]})

    async def names() -> set[str]:
        async with Client(params) as client:
            return {t.name for t in (await client.list_tools()).tools}

    listed = asyncio.run(names())
    assert "run_workflow" in listed and "generate_text" not in listed


def test_install_refuses_unknown_toolsets_and_toolsets_for_http(home):
    env = {**os.environ, "HOME": str(home / "home")}
    unknown = subprocess.run([sys.executable, "-m", "mcp_server", "install", "--client", "codex", "--toolsets",
                              "writing"], capture_output=True, text=True, env=env, cwd=ROOT, timeout=60)
    assert unknown.returncode == 2 and "unknown toolset 'writing'" in unknown.stderr
    assert "core, team, images, all" in unknown.stderr
    with pytest.raises(InstallError, match="--toolsets is for stdio entries"):
        install("codex", "user", home, client_formats.URL, toolsets=("core",))


def test_a_user_scope_entry_finds_the_stack_from_another_directory(home):
    """Set up as a user would, in a project: a data directory and a config file given by relative paths, the
    LLM's URL in that file. The entry's server, started by the agent elsewhere without those variables, uses
    that stack's files and LLM."""
    import anyio
    from mcp import Client, StdioServerParameters

    project, elsewhere = home / "project", home / "elsewhere"
    elsewhere.mkdir()
    (project / "stack.toml").write_text('llm_urls = "http://127.0.0.1:9/v1"\n')
    agent_env = {k: v for k, v in os.environ.items() if not k.startswith("SCRIPTORIUM_")}
    done = subprocess.run([sys.executable, "-m", "mcp_server", "install", "--client", "cursor", "--scope", "user"],
                          capture_output=True, text=True, cwd=project, timeout=120,
                          env={**agent_env, "SCRIPTORIUM_HOME": "stack", "SCRIPTORIUM_CONFIG": "stack.toml",
                               "SCRIPTORIUM_MCP_TOKEN": TOKEN})
    assert done.returncode == 0, done.stderr
    entry = read(home / "home" / ".cursor" / "mcp.json")["mcpServers"]["scriptorium"]
    assert entry["env"] == {"SCRIPTORIUM_HOME": str(project / "stack"), "SCRIPTORIUM_LLM_URL": "http://127.0.0.1:9/v1",
                            "SCRIPTORIUM_CONFIG": str(project / "stack.toml")}
    assert TOKEN not in (home / "home" / ".cursor" / "mcp.json").read_text()
    primed = list((project / "stack" / "cache" / "mcp").glob("answers-*.json"))  # install's start used the stack
    params = StdioServerParameters(command=entry["command"], args=entry["args"], cwd=str(elsewhere),
                                   env={**agent_env, **entry["env"]})

    async def status() -> dict:
        with anyio.fail_after(120):
            async with Client(params) as client:
                return (await client.call_tool("stack_status", {})).structured_content

    assert [u["url"] for u in anyio.run(status)["llm"]] == ["http://127.0.0.1:9/v1"]
    assert primed and list((project / "stack" / "cache" / "mcp").glob("answers-*.json")) == primed
    assert not (elsewhere / "stack").exists() and not (ROOT / "stack").exists()
