"""`python -m mcp_server` over stdio, spoken to line by line: the front (mcp_server/stdio_front.py) answers
initialize (mcp_server/initialize_result.py) and the lists from an earlier start's answers, which must be what
the SDK server itself answers, and hands every other message to the SDK server without the client seeing its own
replayed questions."""

import asyncio
import json
import os
import queue
import subprocess
import sys
import threading

import pytest
from mcp import Client

from common.settings import Settings
from mcp_server import answers_file
from mcp_server.server import build_server
from tests.backend.server_process import ROOT

INIT = {"protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "raw", "version": "1"}}


class Raw:
    """The server as a process, JSON-RPC lines in and out."""

    def __init__(self, settings: Settings, args: list[str] | None = None):
        env = {**os.environ, "SCRIPTORIUM_HOME": str(settings.home), "SCRIPTORIUM_LLM_URL": settings.llm_urls[0]}
        self.proc = subprocess.Popen([sys.executable, "-m", "mcp_server", *(args or [])], cwd=ROOT, env=env, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        self.lines: queue.Queue = queue.Queue()
        threading.Thread(target=lambda: [self.lines.put(json.loads(line)) for line in self.proc.stdout],
                         daemon=True).start()
        self.next_id = 0
        self.notified: list[str] = []  # the notifications' methods, in order

    def send(self, method: str, params: dict | None = None, notify: bool = False) -> int | None:
        message = {"jsonrpc": "2.0", "method": method, **({"params": params} if params is not None else {})}
        if not notify:
            self.next_id += 1
            message["id"] = self.next_id
        self.proc.stdin.write(json.dumps(message).encode() + b"\n")
        self.proc.stdin.flush()
        return message.get("id")

    def answer(self, ident: int) -> dict:
        while True:
            message = self.lines.get(timeout=60)
            if "id" not in message and "method" in message:
                self.notified.append(message["method"])
                continue
            assert isinstance(message.get("id"), int), message  # the front's replayed questions stay inside
            if message["id"] == ident:
                return message

    def ask(self, method: str, params: dict | None = None) -> dict:
        reply = self.answer(self.send(method, params))
        assert "result" in reply, reply
        return reply["result"]

    def close(self) -> int:
        self.proc.stdin.close()
        code = self.proc.wait(timeout=60)
        self.stderr = self.proc.stderr.read().decode(errors="replace")
        while not self.lines.empty():
            message = self.lines.get()
            assert "id" not in message and "method" in message, message
            self.notified.append(message["method"])
        return code


@pytest.fixture
def settings(tmp_path) -> Settings:
    return Settings(home=tmp_path / "home", llm_urls=("http://127.0.0.1:9/v1",), mcp_toolsets=("core",))


def session(settings: Settings) -> dict:
    """One client's start: initialize, the lists, a tool call; what it was answered and notified."""
    raw = Raw(settings)
    seen = {"initialize": raw.ask("initialize", INIT)}
    raw.send("notifications/initialized", notify=True)
    for method in ("tools/list", "prompts/list"):
        seen[method] = raw.ask(method)
    seen["call"] = raw.ask("tools/call", {"name": "list_jobs", "arguments": {}})
    seen["resources"] = raw.ask("resources/list")
    assert raw.close() == 0
    seen["notified"] = raw.notified
    return seen


def in_memory_tools(settings: Settings) -> dict:
    async def go():
        async with Client(build_server(settings)) as client:
            return {t.name: (t.description, t.input_schema) for t in (await client.list_tools()).tools}

    return asyncio.run(go())


def test_a_second_start_answers_as_the_sdk_server_did(settings):
    path = answers_file.locate(settings.home, settings.mcp_toolsets, None).path
    first = session(settings)  # nothing remembered: the SDK server answers everything
    assert path.exists()
    second = session(settings)  # initialize and the lists from the first start's answers, the rest from the SDK
    for method in ("initialize", "tools/list", "prompts/list"):
        assert second[method] == first[method], method
    assert second["initialize"]["serverInfo"]["name"] == "scriptorium"
    assert second["initialize"]["protocolVersion"] == INIT["protocolVersion"]
    assert {t["name"]: (t["description"], t["inputSchema"]) for t in second["tools/list"]["tools"]} \
        == in_memory_tools(settings)
    assert not second["call"].get("isError") and second["call"] == first["call"]
    assert first["notified"] == second["notified"] == []  # what the client was told is the SDK server's


def test_remembered_answers_that_differ_from_the_sdks_are_replaced(settings):
    session(settings)
    kept = answers_file.locate(settings.home, settings.mcp_toolsets, None)
    true = answers_file.read(kept)
    stale = answers_file.read(kept)
    stale["tools/list"][INIT["protocolVersion"]]["tools"][0]["description"] = "stale"
    # kept as this install keeps answers (a file edited by hand is not used: test_stdio_answers_trust.py)
    answers_file.remember(kept, INIT["protocolVersion"], {m: stale[m][INIT["protocolVersion"]] for m in stale})
    seen = session(settings)  # served the stale list (the code has not changed, so its answers should not have)...
    assert seen["tools/list"] == stale["tools/list"][INIT["protocolVersion"]]
    assert seen["notified"] == ["notifications/tools/list_changed"]  # ...told the client it changed...
    assert answers_file.read(kept) == true  # ...and put the SDK's back
    assert session(settings)["tools/list"] == true["tools/list"][INIT["protocolVersion"]]


def test_a_new_protocol_version_gets_the_sdk_servers_lists(settings):
    session(settings)
    raw = Raw(settings)
    result = raw.ask("initialize", {**INIT, "protocolVersion": "2025-03-26"})
    assert result["protocolVersion"] == "2025-03-26"
    raw.send("notifications/initialized", notify=True)
    assert {t["name"] for t in raw.ask("tools/list")["tools"]} == set(in_memory_tools(settings))
    assert raw.close() == 0


def test_a_client_that_leaves_at_once_ends_the_server(settings):
    session(settings)
    raw = Raw(settings)
    raw.ask("initialize", INIT)  # answered by the front, the SDK not loaded yet
    assert raw.close() == 0


def test_a_message_before_initialize_goes_to_the_sdk(settings):
    raw = Raw(settings)
    reply = raw.answer(raw.send("tools/list"))
    assert "result" in reply or "error" in reply, reply
    assert raw.close() == 0
