"""The shared-run tests' server: `python -m mcp_server --http` as a real process against the real backend and the
ComfyUI stand-in, allowed to read one directory."""

import os

import pytest

from common.settings import Settings
from tests.mcp_server.client_formats import TOKEN
from tests.mcp_server.http_server import MCPHTTPServer


@pytest.fixture
def served(tmp_path, llm_server, comfyui):
    settings = Settings(home=tmp_path / "home", llm_urls=(f"{llm_server.url}/v1",), comfyui_url=comfyui.url)
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    env = {
        **os.environ,
        "SCRIPTORIUM_HOME": str(settings.home),
        "SCRIPTORIUM_LLM_URL": settings.llm_urls[0],
        "SCRIPTORIUM_COMFYUI_URL": comfyui.url,
        "SCRIPTORIUM_MCP_ALLOWED_DIRS": str(allowed),
        "SCRIPTORIUM_MCP_BUDGET": "40",
        "SCRIPTORIUM_MCP_TOOLSETS": "core,team",
    }
    env.pop("SCRIPTORIUM_MCP_TOKEN", None)
    server = MCPHTTPServer(env, cwd=tmp_path)
    yield server, settings, allowed
    server.stop()


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    for var in ("XDG_CONFIG_HOME", "CODEX_HOME", "HERMES_HOME", "SCRIPTORIUM_LLM_URL", "SCRIPTORIUM_CONFIG",
                "SCRIPTORIUM_COMFYUI_URL", "SCRIPTORIUM_LLM_MODEL"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("SCRIPTORIUM_HOME", str(tmp_path / "data"))
    monkeypatch.setenv("SCRIPTORIUM_MCP_TOKEN", TOKEN)
    monkeypatch.setenv("PATH", "/usr/bin:/bin")  # no claude CLI unless a test puts one there
    (tmp_path / "home").mkdir()
    (tmp_path / "project").mkdir()
    return tmp_path
