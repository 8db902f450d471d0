"""The very first stdio start (no remembered answers): `initialize` is answered before the SDK has loaded, with
the protocol version the spec's negotiation gives and exactly what the SDK server itself answers; everything
after it goes to the SDK server. The official `mcp` client speaks to the real `python -m mcp_server`."""

import os
import sys
import textwrap

import anyio
import mcp_types.version
import pytest
from mcp import ClientSession, StdioServerParameters, stdio_client

from common.settings import Settings
from mcp_server import answers_file, initialize_result
from tests.backend.server_process import ROOT
from tests.mcp_server.test_stdio_front import Raw, in_memory_tools

# Imported in the child through PYTHONPATH: the SDK server's module (imported by mcp_server/server.py) waits to run
# until the test creates the release file, as a slow SDK import on a loaded machine would, without holding
# Python's import lock.
GATE = textwrap.dedent("""
    import importlib.machinery, os, sys, time

    class SlowSDK:
        def find_spec(self, name, path=None, target=None):
            if name != "mcp.server.mcpserver":
                return None
            spec = importlib.machinery.PathFinder.find_spec(name, path)
            run = spec.loader.exec_module

            def exec_module(module):
                while not os.path.exists(os.environ["SDK_RELEASE"]):
                    time.sleep(0.02)
                run(module)

            spec.loader.exec_module = exec_module
            return spec

    sys.meta_path.insert(0, SlowSDK())
""")


@pytest.fixture
def settings(tmp_path) -> Settings:
    return Settings(home=tmp_path / "home", llm_urls=("http://127.0.0.1:9/v1",), mcp_toolsets=("core",))


def test_the_first_start_answers_initialize_before_the_sdk_loads(settings, tmp_path):
    gate = tmp_path / "gate"
    gate.mkdir()
    (gate / "sitecustomize.py").write_text(GATE)
    release = tmp_path / "release"
    env = {
        **os.environ,
        "SCRIPTORIUM_HOME": str(settings.home),
        "SCRIPTORIUM_LLM_URL": settings.llm_urls[0],
        "SCRIPTORIUM_MCP_TOOLSETS": "core",
        "PYTHONPATH": str(gate),
        "SDK_RELEASE": str(release),
    }
    params = StdioServerParameters(command=sys.executable, args=["-m", "mcp_server"], cwd=str(ROOT), env=env)
    assert not answers_file.locate(settings.home, settings.mcp_toolsets, None).path.exists()

    async def go():
        with open(tmp_path / "stderr.log", "w") as errlog:
            async with (
                stdio_client(params, errlog=errlog) as (read, write),
                ClientSession(read, write) as session,
            ):
                with anyio.fail_after(30):  # the SDK cannot load before the release file exists
                    init = await session.initialize()
                release.touch()
                with anyio.fail_after(120):
                    tools = (await session.list_tools()).tools
                    called = await session.call_tool("list_jobs", {})
        return init, tools, called

    init, tools, called = anyio.run(go)
    assert init.protocol_version == mcp_types.version.LATEST_HANDSHAKE_VERSION  # what the client asked for
    assert init.server_info.name == "scriptorium" and init.capabilities.tools.list_changed
    assert {t.name: (t.description, t.input_schema) for t in tools} == in_memory_tools(settings)
    assert not called.is_error and called.structured_content is not None
    assert "warning" not in (tmp_path / "stderr.log").read_text()


@pytest.mark.parametrize(
    ("asked", "toolsets"),
    [
        ("2024-11-05", ("core",)),
        ("2025-06-18", ("core", "team")),  # the team toolset adds to the instructions
        ("2026-07-28", ("core",)),  # a version not negotiated through initialize: the latest that is
        ("2099-01-01", ("core",)),
    ],
)
def test_the_front_answers_initialize_as_the_sdk_server_does(tmp_path, asked, toolsets):
    settings = Settings(home=tmp_path / "home", llm_urls=("http://127.0.0.1:9/v1",), mcp_toolsets=toolsets)
    raw = Raw(settings, ["--toolsets", ",".join(toolsets)])
    init = {"protocolVersion": asked, "capabilities": {}, "clientInfo": {"name": "raw", "version": "1"}}
    told = raw.ask("initialize", init)
    raw.send("notifications/initialized", notify=True)
    raw.ask("tools/list")  # answered by the SDK server, after it answered the replayed initialize
    raw.ask("ping")
    assert raw.close() == 0
    expected = (
        asked
        if asked in mcp_types.version.HANDSHAKE_PROTOCOL_VERSIONS
        else mcp_types.version.LATEST_HANDSHAKE_VERSION
    )
    assert told["protocolVersion"] == expected
    # the file keeps the SDK server's own initialize result, under the version the client was told
    kept = answers_file.read(answers_file.locate(settings.home, toolsets, None))
    assert kept["initialize"] == {expected: told}
    assert "warning" not in raw.stderr


def test_the_front_negotiates_the_versions_the_sdk_does():
    assert initialize_result.HANDSHAKE_VERSIONS == mcp_types.version.HANDSHAKE_PROTOCOL_VERSIONS


def test_an_initialize_the_sdk_refuses_gets_the_sdks_error(settings):
    raw = Raw(settings)
    reply = raw.answer(raw.send("initialize", {"protocolVersion": "2025-06-18", "capabilities": {}}))
    assert "error" in reply and "result" not in reply, reply
    assert raw.close() == 0
