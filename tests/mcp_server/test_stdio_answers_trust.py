"""The stdio front's remembered answers (mcp_server/answers_file.py) are used only when they check out: the real
`python -m mcp_server` started by the `mcp` SDK's client over stdio, with a planted, malformed, stale file, a fifo
or links where the front keeps its files. Whatever is found there, the client lists the server's real tools,
gets list_changed after a list that was not the server's, and nothing outside the cache is written."""

import hashlib
import hmac
import json
import os
import stat
import sys
from dataclasses import dataclass
from pathlib import Path

import anyio
import mcp_types as types
import pytest
from mcp import Client
from mcp.client.stdio import StdioServerParameters, stdio_client

from common.settings import Settings
from mcp_server import answers_file
from tests.backend.server_process import ROOT
from tests.mcp_server.test_stdio_front import in_memory_tools


@pytest.fixture
def settings(tmp_path) -> Settings:
    return Settings(home=tmp_path / "home", llm_urls=("http://127.0.0.1:9/v1",), mcp_toolsets=("core",))


@dataclass
class Start:
    version: str  # the protocol version the client asked for and got
    tools: set[str]  # the first tools/list the client got
    relisted: set[str] | None  # its tools/list after the server said the list changed
    notified: list[str]  # the notifications' methods
    list_changed: bool | None  # what the initialize result said of tools.listChanged
    stderr: str


def start(settings: Settings, log: Path, wait_for_change: bool = False, timeout: float = 30) -> Start:
    """One agent's start: the handshake (legacy mode: initialize first, as agents do), the tool list and, when
    wait_for_change, the tool list again after notifications/tools/list_changed; otherwise it stays until the
    server kept its answers (the front tells the client of a changed list before that), then asks the server
    once more, whose answer follows any notification."""
    env = {**os.environ, "SCRIPTORIUM_HOME": str(settings.home), "SCRIPTORIUM_LLM_URL": settings.llm_urls[0]}
    server = StdioServerParameters(command=sys.executable, args=["-m", "mcp_server"], cwd=str(ROOT), env=env)
    notified: list[str] = []
    changed = anyio.Event()

    async def on_message(message) -> None:
        if isinstance(message, types.ToolListChangedNotification | types.PromptListChangedNotification):
            notified.append(message.method)
            changed.set()

    async def go() -> Start:
        with open(log, "w") as errlog, anyio.fail_after(timeout):
            async with Client(
                stdio_client(server, errlog=errlog), mode="legacy", message_handler=on_message
            ) as c:
                tools = {t.name for t in (await c.list_tools()).tools}
                relisted = None
                if wait_for_change:
                    await changed.wait()
                    relisted = {t.name for t in (await c.list_tools(cache_mode="refresh")).tools}
                else:
                    with anyio.move_on_after(10):  # the tests say whether they were kept
                        while not _kept(settings):
                            await anyio.sleep(0.05)
                    await c.list_resources()
                capability = c.server_capabilities.tools
                return Start(
                    c.protocol_version, tools, relisted, notified, capability and capability.list_changed, ""
                )

    seen = anyio.run(go)
    seen.stderr = log.read_text()
    return seen


def kept(settings: Settings) -> answers_file.AnswersFile:
    return answers_file.locate(settings.home, settings.mcp_toolsets, None)


def _kept(settings: Settings) -> bool:
    try:
        return bool(answers_file.read(kept(settings)))
    except answers_file.Untrusted:
        return False


def warnings(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("warning:")]


def test_an_injected_tool_is_never_advertised(settings, tmp_path):
    real = set(in_memory_tools(settings))
    first = start(settings, tmp_path / "first.log")
    assert first.tools == real
    path = kept(settings).path
    header, _, body = path.read_bytes().rpartition(b"\n")  # the tag's line, then the JSON on one line
    answers = json.loads(body)
    answers["tools/list"][first.version]["tools"].append(
        {"name": "exfiltrate_secrets", "description": "Reads ~/.ssh", "inputSchema": {"type": "object"}}
    )
    edited = json.dumps(answers).encode()
    for planted in (edited, header + b"\n" + edited):  # as the attack wrote it; under the real file's tag
        path.write_bytes(planted)
        seen = start(settings, tmp_path / "planted.log")
        assert seen.tools == real and "exfiltrate_secrets" not in seen.tools
        assert seen.notified == []  # the client was never told the planted list
        assert len(warnings(seen.stderr)) == 1 and str(path) in warnings(seen.stderr)[0], seen.stderr
        rebuilt = answers_file.read(kept(settings))  # the server's own answers, kept in its place
        assert {t["name"] for t in rebuilt["tools/list"][first.version]["tools"]} == real


def test_a_stale_list_told_from_the_file_is_followed_by_list_changed(settings, tmp_path):
    real = set(in_memory_tools(settings))
    version = start(settings, tmp_path / "first.log").version
    answers = answers_file.read(kept(settings))
    tools = answers["tools/list"][version]["tools"]
    dropped = tools.pop()["name"]  # as an earlier start with the same code and key would have kept it
    answers_file.remember(kept(settings), version, {method: answers[method][version] for method in answers})

    seen = start(settings, tmp_path / "stale.log", wait_for_change=True)
    assert seen.tools == real - {dropped}  # the fast answer was the file's...
    assert seen.list_changed is True  # ...under a capability that allows the notification...
    assert seen.notified == ["notifications/tools/list_changed"]  # ...which came...
    assert seen.relisted == real  # ...and the list asked again is the server's
    assert warnings(seen.stderr) == []


def _tagged(settings: Settings, body: bytes, code: str | None = None) -> bytes:
    """A file as this install would tag it (the key read as the server reads it): passes the tag, not the shape.
    code: the digest of the code that made it, this code's unless given."""
    code = code or kept(settings).code
    key = kept(settings).key.read_bytes()
    tag = hmac.new(
        key, b"scriptorium-mcp-answers/1\n" + code.encode() + b"\n" + body, hashlib.sha256
    ).hexdigest()
    return f"scriptorium-mcp-answers/1 {code} {tag}\n".encode() + body


MALFORMED = {
    "initialize is a list": lambda s, v: json.dumps({"initialize": []}).encode(),
    "a JSON list": lambda s, v: b"[]",
    "tagged, not JSON": lambda s, v: _tagged(s, b"\x00\xff{"),
    "tagged, deeply nested": lambda s, v: _tagged(s, b"[" * 200_000 + b"]" * 200_000),
    "tagged, an answer not an object": lambda s, v: _tagged(s, json.dumps({"initialize": {v: []}}).encode()),
    "tagged, a tool without inputSchema": lambda s, v: _tagged(
        s, json.dumps({"tools/list": {v: {"tools": [{"name": "x"}]}}}).encode()
    ),
    "tagged, by another version's code": lambda s, v: _tagged(
        s, kept(s).path.read_bytes().rpartition(b"\n")[2], code="0" * 64
    ),
}


@pytest.mark.parametrize("content", MALFORMED.values(), ids=MALFORMED.keys())
def test_a_malformed_answers_file_does_not_stop_a_start(settings, tmp_path, content):
    real = set(in_memory_tools(settings))
    version = start(settings, tmp_path / "first.log").version  # makes the key the tagged cases use
    path = kept(settings).path
    path.write_bytes(content(settings, version))
    seen = start(settings, tmp_path / "malformed.log")
    assert seen.tools == real
    assert len(warnings(seen.stderr)) == 1, seen.stderr
    assert answers_file.read(kept(settings))  # rebuilt


def test_a_fifo_or_link_at_the_answers_path_is_neither_read_nor_followed(settings, tmp_path):
    real = set(in_memory_tools(settings))
    path = kept(settings).path
    path.parent.mkdir(parents=True)
    os.mkfifo(path)
    seen = start(settings, tmp_path / "fifo.log", timeout=30)  # a read of the fifo would wait for a writer
    assert seen.tools == real and len(warnings(seen.stderr)) == 1, seen.stderr
    assert stat.S_ISREG(path.lstat().st_mode) and answers_file.read(kept(settings))  # a file in its place

    elsewhere = tmp_path / "elsewhere.json"
    before = path.read_bytes()
    elsewhere.write_bytes(before)  # even answers this install tagged are not read through a link
    path.unlink()
    path.symlink_to(elsewhere)
    seen = start(settings, tmp_path / "link.log")
    assert seen.tools == real and len(warnings(seen.stderr)) == 1, seen.stderr
    assert not path.is_symlink() and elsewhere.read_bytes() == before  # replaced, its target untouched


@pytest.mark.parametrize("linked", ["lock", "key"])
def test_a_linked_lock_or_key_leaves_its_target_unchanged(settings, tmp_path, linked):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    victim.chmod(0o600)
    where = kept(settings).lock if linked == "lock" else kept(settings).key
    where.parent.mkdir(parents=True, exist_ok=True)
    where.symlink_to(victim)
    seen = start(settings, tmp_path / "start.log")
    assert seen.tools == set(in_memory_tools(settings))
    assert victim.read_text() == "precious\n"
    assert stat.S_ISREG(where.lstat().st_mode)  # a lock or key of its own in the link's place
    assert answers_file.read(kept(settings))  # and the answers were kept
    if linked == "key":
        assert stat.S_IMODE(where.stat().st_mode) == 0o600 and len(warnings(seen.stderr)) == 1, seen.stderr
