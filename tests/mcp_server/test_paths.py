"""File arguments stay inside the client's roots or the allowed directories: unit checks, then the SDK client
in memory and over stdio (a real server process), with and without roots."""

import asyncio
import os
import sys
from pathlib import Path

import pytest
from mcp import Client, StdioServerParameters
from mcp.types import ListRootsResult, Root

from common.settings import Settings
from mcp_server.allowed_paths import FileAccess, PathRefused, root_paths
from mcp_server.server import build_server
from tests.backend.server_process import ROOT, free_port


@pytest.fixture
def tree(tmp_path) -> Path:
    (tmp_path / "allowed" / "notes").mkdir(parents=True)
    (tmp_path / "allowed" / "notes" / "a.md").write_text("# notes\n")
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "secret.txt").write_text("secret\n")
    (tmp_path / "allowed" / "link.txt").symlink_to(tmp_path / "outside" / "secret.txt")
    return tmp_path


def test_setting_default_symlinks_and_dotdot(tree):
    access = FileAccess.for_transport("stdio", (str(tree / "allowed"),))
    assert access.check(str(tree / "allowed" / "notes" / "a.md"), None) == tree / "allowed" / "notes" / "a.md"
    assert access.check("notes/a.md", None) == tree / "allowed" / "notes" / "a.md"  # relative: to the first dir
    for bad in ("/etc/passwd", str(tree / "allowed" / "link.txt"), str(tree / "allowed" / ".." / "outside")):
        with pytest.raises(PathRefused, match="SCRIPTORIUM_MCP_ALLOWED_DIRS"):
            access.check(bad, None)
    assert FileAccess.for_transport("stdio", None, cwd=tree / "allowed").allowed == (tree / "allowed",)
    assert FileAccess.for_transport("stdio", None, cwd=Path("/")).allowed == ()
    assert FileAccess.for_transport("stdio", None, cwd=Path.home()).allowed == ()
    http = FileAccess.for_transport("http", None)
    with pytest.raises(PathRefused, match="an HTTP server reads no files"):
        http.check(str(tree / "allowed" / "notes" / "a.md"), None)


def test_roots_replace_the_setting_over_stdio_and_narrow_it_over_http(tree):
    roots = root_paths(ListRootsResult(roots=[Root(uri=(tree / "outside").as_uri()), Root(uri="file://elsewhere/x")]))
    assert roots == (tree / "outside",)
    stdio = FileAccess.for_transport("stdio", (str(tree / "allowed"),))
    assert stdio.check(str(tree / "outside" / "secret.txt"), roots) == tree / "outside" / "secret.txt"
    with pytest.raises(PathRefused, match="your client's roots"):
        stdio.check(str(tree / "allowed" / "notes" / "a.md"), roots)
    http = FileAccess.for_transport("http", (str(tree / "allowed"),))
    everything = root_paths(ListRootsResult(roots=[Root(uri="file:///")]))
    assert http.check(str(tree / "allowed" / "notes" / "a.md"), everything)  # a root of / widens nothing
    with pytest.raises(PathRefused):
        http.check("/etc/passwd", everything)
    narrow = root_paths(ListRootsResult(roots=[Root(uri=(tree / "allowed" / "notes").as_uri())]))
    with pytest.raises(PathRefused):
        http.check(str(tree / "allowed" / "link.txt"), narrow)


def dead_llm(tmp_path, **kw) -> Settings:
    return Settings(home=tmp_path / "home", llm_urls=(f"http://127.0.0.1:{free_port()}/v1",), **kw)


def test_tools_refuse_files_outside_the_roots_in_memory(tree):
    settings = dead_llm(tree, mcp_allowed_dirs=(str(tree / "allowed"),), comfyui_url="http://127.0.0.1:9")

    async def roots(_ctx):
        return ListRootsResult(roots=[Root(uri=(tree / "allowed" / "notes").as_uri(), name="notes")])

    async def go():
        async with Client(build_server(settings), list_roots_callback=roots) as client:
            refused = await client.call_tool("start_pipeline", {"topic": "x", "sources": ["/etc/passwd"]})
            assert refused.is_error and "'/etc/passwd'" in refused.content[0].text
            assert "your client's roots" in refused.content[0].text
            image = await client.call_tool("generate_image", {"prompt": "x", "template": str(tree / "outside")})
            assert image.is_error and "template" in image.content[0].text and "outside" in image.content[0].text
            ok = await client.call_tool("start_pipeline", {"topic": "x", "images": 0,
                                                           "sources": [str(tree / "allowed" / "notes" / "a.md")]})
            assert not ok.is_error, ok.content[0].text
            await client.call_tool("cancel_job", {"job_id": ok.structured_content["job_id"]})

    asyncio.run(go())


@pytest.mark.parametrize("mode", ["legacy", "auto"])  # a 2025 handshake (today's clients) and the SDK's newest
def test_stdio_uses_the_roots_or_the_working_directory(tree, mode):
    settings = dead_llm(tree)
    env = {**os.environ, "SCRIPTORIUM_HOME": str(settings.home), "SCRIPTORIUM_LLM_URL": settings.llm_urls[0],
           "PYTHONPATH": str(ROOT)}
    env.pop("SCRIPTORIUM_MCP_ALLOWED_DIRS", None)
    params = StdioServerParameters(command=sys.executable, args=["-m", "mcp_server"], cwd=str(tree / "allowed"),
                                   env=env)

    async def roots(_ctx):
        return ListRootsResult(roots=[Root(uri=(tree / "outside").as_uri())])

    async def go():
        async with Client(params, mode=mode) as client:  # no roots: the working directory
            refused = await client.call_tool("start_pipeline", {"topic": "x", "sources": ["/etc/passwd"]})
            assert refused.is_error and "SCRIPTORIUM_MCP_ALLOWED_DIRS" in refused.content[0].text
            link = await client.call_tool("start_pipeline", {"topic": "x", "sources": ["link.txt"]})
            assert link.is_error and "secret.txt" in link.content[0].text
            ok = await client.call_tool("start_pipeline", {"topic": "x", "images": 0, "sources": ["notes/a.md"]})
            assert not ok.is_error, ok.content[0].text
            await client.call_tool("cancel_job", {"job_id": ok.structured_content["job_id"]})
        async with Client(params, mode=mode, list_roots_callback=roots) as client:
            inside = await client.call_tool("start_pipeline", {"topic": "x", "images": 0,
                                                               "sources": [str(tree / "outside" / "secret.txt")]})
            assert not inside.is_error, inside.content[0].text
            await client.call_tool("cancel_job", {"job_id": inside.structured_content["job_id"]})
            cwd_file = await client.call_tool("start_pipeline", {"topic": "x",
                                                                 "sources": [str(tree / "allowed" / "notes" / "a.md")]})
            assert cwd_file.is_error and "your client's roots" in cwd_file.content[0].text

    asyncio.run(go())
