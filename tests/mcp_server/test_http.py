"""The streamable HTTP transport as a real process: the token (any case of Bearer, constant-time compared) and
its RFC 6750 challenges, the Host/Origin allow-list, and which files a tool may read."""

import asyncio
import os
import subprocess
import sys

import httpx
import httpx2
import pytest
from mcp import Client
from mcp.client.streamable_http import streamable_http_client
from mcp.types import ListRootsResult, Root

from common.settings import Settings
from tests.backend.server_process import ROOT, free_port
from tests.mcp_server.http_server import MCPHTTPServer

TOKEN = "s3cret-9c1f"
PUBLIC = "https://scriptorium.test/mcp"
INIT = {"jsonrpc": "2.0", "id": 1, "method": "initialize",
        "params": {"protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "t", "version": "1"}}}
HEADERS = {"Accept": "application/json, text/event-stream", "Content-Type": "application/json"}


def child_env(settings: Settings, **extra) -> dict:
    env = {**os.environ, "SCRIPTORIUM_HOME": str(settings.home), "SCRIPTORIUM_LLM_URL": settings.llm_urls[0],
           "SCRIPTORIUM_COMFYUI_URL": settings.comfyui_url or "", **extra}
    for var in ("SCRIPTORIUM_MCP_ALLOWED_DIRS", "SCRIPTORIUM_MCP_ALLOWED_HOSTS", "SCRIPTORIUM_MCP_PUBLIC_URL"):
        if var not in extra:
            env.pop(var, None)
    return env


@pytest.fixture
def exposed(tmp_path):
    """A server bound to every interface, with a token, a public https URL and one extra allowed host."""
    (tmp_path / "allowed").mkdir()
    (tmp_path / "allowed" / "notes.md").write_text("notes\n")
    settings = Settings(home=tmp_path / "home", llm_urls=(f"http://127.0.0.1:{free_port()}/v1",))
    server = MCPHTTPServer(child_env(settings, SCRIPTORIUM_MCP_TOKEN=TOKEN, SCRIPTORIUM_MCP_PUBLIC_URL=PUBLIC,
                                     SCRIPTORIUM_MCP_ALLOWED_HOSTS="agents.lan",
                                     SCRIPTORIUM_MCP_ALLOWED_DIRS=str(tmp_path / "allowed")),
                           host="0.0.0.0", cwd=tmp_path)
    yield server, tmp_path
    server.stop()


def test_token_challenges_follow_rfc_6750(exposed):
    server, _ = exposed
    # RFC 6750 3.1: a request without credentials gets the challenge without an error code.
    for headers in (HEADERS, {**HEADERS, "Authorization": "Basic dXNlcjpwdw=="}):
        refused = httpx.post(f"{server.url}/mcp", json=INIT, headers=headers)
        assert refused.status_code == 401 and "SCRIPTORIUM_MCP_TOKEN" in refused.json()["message"]
        challenge = refused.headers["www-authenticate"]
        assert challenge.startswith("Bearer ") and 'realm="' in challenge and "error=" not in challenge, challenge
    for token in (f"{TOKEN}x", TOKEN[:-1], ""):  # a wrong token, a prefix of the right one, none after Bearer
        given = f"Bearer {token}".strip()
        wrong = httpx.post(f"{server.url}/mcp", json=INIT, headers={**HEADERS, "Authorization": given})
        challenge = wrong.headers["www-authenticate"]
        assert wrong.status_code == 401 and 'realm="' in challenge and 'error="invalid_token"' in challenge
    for scheme in ("Bearer", "bearer", "BEARER"):
        ok = httpx.post(f"{server.url}/mcp", json=INIT, headers={**HEADERS, "Authorization": f"{scheme} {TOKEN}"})
        assert ok.status_code == 200, (scheme, ok.text)
    # No OAuth authorization server exists, so no metadata names one.
    for path in ("/.well-known/oauth-protected-resource/mcp", "/.well-known/oauth-protected-resource"):
        metadata = httpx.get(f"{server.url}{path}", headers={"Authorization": f"Bearer {TOKEN}"})
        assert metadata.status_code == 404 or "authorization_servers" not in metadata.json(), path
    assert httpx.get(f"{server.url}/health").status_code == 200  # health checks carry no token


def test_host_and_origin_allow_list(exposed):
    server, _ = exposed
    auth = {**HEADERS, "Authorization": f"Bearer {TOKEN}"}
    port = server.port
    bad_host = httpx.post(f"{server.url}/mcp", json=INIT, headers={**auth, "Host": "evil.example"})
    assert bad_host.status_code == 421 and "SCRIPTORIUM_MCP_ALLOWED_HOSTS" in bad_host.json()["message"]
    for host in ("scriptorium.test", f"agents.lan:{port}", f"127.0.0.1:{port}"):
        passed = httpx.post(f"{server.url}/mcp", json=INIT, headers={**auth, "Host": host})
        assert passed.status_code == 200, (host, passed.text)
    bad_origin = httpx.post(f"{server.url}/mcp", json=INIT, headers={**auth, "Origin": "http://evil.example"})
    assert bad_origin.status_code == 403 and "SCRIPTORIUM_MCP_ALLOWED_ORIGINS" in bad_origin.json()["message"]
    good_origin = httpx.post(f"{server.url}/mcp", json=INIT, headers={**auth, "Origin": "https://scriptorium.test"})
    assert good_origin.status_code == 200


def test_sdk_client_with_a_lowercase_bearer_reads_only_allowed_files(exposed):
    server, tmp = exposed

    async def everything(_ctx):  # a client declaring / as its root gains nothing over HTTP
        return ListRootsResult(roots=[Root(uri="file:///")])

    async def go():
        async with httpx2.AsyncClient(headers={"Authorization": f"bearer {TOKEN}"},
                                      timeout=httpx2.Timeout(30, read=60)) as http, \
                Client(streamable_http_client(f"{server.url}/mcp", http_client=http), mode="legacy",
                       list_roots_callback=everything) as client:
            assert "start_pipeline" in {t.name for t in (await client.list_tools()).tools}
            refused = await client.call_tool("start_pipeline", {"topic": "x", "sources": ["/etc/passwd"]})
            assert refused.is_error and "SCRIPTORIUM_MCP_ALLOWED_DIRS" in refused.content[0].text
            ok = await client.call_tool("start_pipeline", {"topic": "x", "images": 0,
                                                           "sources": [str(tmp / "allowed" / "notes.md")]})
            assert not ok.is_error, ok.content[0].text
            await client.call_tool("cancel_job", {"job_id": ok.structured_content["job_id"]})

    asyncio.run(go())


def test_localhost_without_a_token_reads_no_files_by_default(tmp_path):
    (tmp_path / "notes.md").write_text("notes\n")
    settings = Settings(home=tmp_path / "home", llm_urls=(f"http://127.0.0.1:{free_port()}/v1",))
    env = child_env(settings)
    env.pop("SCRIPTORIUM_MCP_TOKEN", None)
    server = MCPHTTPServer(env, cwd=tmp_path)
    try:
        async def go():
            async with Client(f"{server.url}/mcp") as client:
                refused = await client.call_tool("start_pipeline", {"topic": "x", "sources": ["notes.md"]})
                assert refused.is_error and "an HTTP server reads no files" in refused.content[0].text

        asyncio.run(go())
    finally:
        server.stop()


def test_binding_beyond_localhost_needs_a_token(tmp_path):
    env = child_env(Settings(home=tmp_path / "home"))
    env.pop("SCRIPTORIUM_MCP_TOKEN", None)
    result = subprocess.run([sys.executable, "-m", "mcp_server", "--http", "--host", "0.0.0.0", "--port",
                             str(free_port())], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "without a token; set SCRIPTORIUM_MCP_TOKEN" in result.stderr
