"""The router over three real backends serving the same model: load spread by requests in flight, a backend killed
mid-run (requests complete elsewhere, streams complete or fail visibly), skipped while dead, used again once back;
`ops status` shows what the router sees."""

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

from orchestrator.clients.llm_client import LLMError
from orchestrator.clients.router import LLMRouter
from tests.backend.server_process import ROOT, ServerProcess

PROMPT = [{"role": "user", "content": "Write about quills."}]
LONG = {"max_tokens": 128, "extra": {"ignore_eos": True}}


def finished(url: str) -> int:
    """Requests the backend finished, from its own /metrics."""
    text = httpx.get(f"{url}/metrics", timeout=5).text
    return int(sum(float(line.split()[-1]) for line in text.splitlines()
                   if line.startswith("scriptorium_requests_total")))


def ops_status(home, urls) -> dict:
    env = {**os.environ, "SCRIPTORIUM_HOME": str(home), "SCRIPTORIUM_LLM_URL": ",".join(urls)}
    done = subprocess.run([sys.executable, "-m", "ops", "status", "--json"], capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=60)
    assert done.returncode == 0, done.stderr
    return {row["url"]: row for row in json.loads(done.stdout)["upstreams"]}


def test_three_upstreams_share_the_load_survive_a_kill_and_take_it_back(tmp_path, tiny_dir):
    model = tiny_dir("llama")
    servers = [ServerProcess(str(model), "--served-model-name", "tiny", wait=False) for _ in range(3)]
    for server in servers:  # started together: their start-ups overlap
        server.wait_ready()
    urls = [f"{s.url}/v1" for s in servers]
    victim = servers[1]
    home = tmp_path / "home"
    try:
        async def scenario():
            async with LLMRouter(urls, backoff=0.5, connect_wait=30, home=home) as router:
                pool = {u.url: u for u in router.pool}
                done = 0

                async def one(i: int):
                    nonlocal done
                    try:
                        # Long enough (the chats with no early end token) that the victim still holds some when
                        # the poll below sees them.
                        if i % 4 == 3:
                            try:
                                return "stream", "".join([d async for d in router.stream_chat(PROMPT, max_tokens=128)])
                            except LLMError as e:
                                return "stream-error", str(e)
                        return "chat", await router.chat(PROMPT, temperature=0, **LONG)
                    finally:
                        done += 1

                # A first wave completes on all three; then 32 at once, so that each upstream holds about ten
                # whatever the kernels' speed (staggered starts let fast kernels finish each before the next).
                first = await asyncio.gather(*(one(i) for i in range(8)))
                tasks = [asyncio.create_task(one(i)) for i in range(8, 40)]
                while pool[urls[1]].in_flight < 2:
                    assert done < 40, "the run ended before the kill"
                    await asyncio.sleep(0.005)
                sent = {url: up.picks for url, up in pool.items()}  # the victim has requests in flight now
                os.killpg(victim.proc.pid, signal.SIGKILL)
                results = first + await asyncio.gather(*tasks)
                victim.proc.wait()

                # every non-streamed request completed; every stream completed or said it is incomplete
                chats = [r for kind, r in results if kind == "chat"]
                assert len(chats) == 30 and all(r["usage"]["completion_tokens"] > 0 for r in chats)
                for kind, r in results:
                    if kind == "stream-error":
                        assert "broke off before the answer was complete" in r and urls[1] in r
                assert all(n > 0 for n in sent.values()), sent  # each got some before the kill
                assert [finished(s.url) > 0 for s in (servers[0], servers[2])] == [True, True]

                # the dead one is skipped: requests go on at once, none to it
                dead = pool[urls[1]]
                served_dead = dead.served
                started = time.monotonic()
                again = await asyncio.gather(*(router.chat(PROMPT, max_tokens=8) for _ in range(12)))
                assert len(again) == 12 and dead.served == served_dead and dead.in_flight == 0
                assert time.monotonic() - started < 30
                rows = {r["url"]: r for r in await router.upstreams()}
                assert rows[urls[1]]["healthy"] is False and rows[urls[1]]["last_failure"] is not None
                assert rows[urls[0]]["healthy"] and rows[urls[0]]["models"] == ["tiny"]

                # The router publishes its counts for ops within half a second of a change (debounced), so
                # what ops reads may lag the last request by that much.
                deadline = time.monotonic() + 10
                status = await asyncio.to_thread(ops_status, home, urls)
                while any(row["in_flight"] for row in status.values()) and time.monotonic() < deadline:
                    await asyncio.sleep(0.25)
                    status = await asyncio.to_thread(ops_status, home, urls)
                assert status[urls[1]]["healthy"] is False and status[urls[1]]["last_failure"] is not None
                assert status[urls[0]]["healthy"] and status[urls[0]]["models"] == ["tiny"]
                assert status[urls[0]]["served"] > 0 and status[urls[0]]["routers"] == 1
                assert all(row["in_flight"] == 0 for row in status.values())

                # back on the same port: probed, then it gets traffic again
                servers[1] = ServerProcess(str(model), "--served-model-name", "tiny", port=victim.port)
                deadline = time.monotonic() + 60
                while dead.served == served_dead:
                    assert time.monotonic() < deadline, "the restarted upstream never got traffic again"
                    await asyncio.gather(*(router.chat(PROMPT, max_tokens=4) for _ in range(6)))
                assert finished(servers[1].url) > 0 and dead.failures == 0
            assert not list((home / "state" / "upstreams").glob("*.json"))  # closed: its table is gone

        asyncio.run(scenario())
    finally:
        for server in servers:
            server.stop()


class CutOffServer:
    """Answers /models, and every chat stream with two chunks, then closes the connection: an upstream dying
    mid-answer (chunked body left incomplete) or, with clean=True, ending the body without data: [DONE]."""

    def __init__(self, clean: bool = False):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}/v1"
        self.clean = clean
        threading.Thread(target=self.serve, daemon=True).start()

    def serve(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                request = self.read(conn)
                if "/models" in request.split("\r\n")[0]:
                    body = json.dumps({"object": "list", "data": [{"id": "tiny", "object": "model"}]}).encode()
                    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nConnection: close\r\n"
                                 b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
                    continue
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n"
                             b"Connection: close\r\n\r\n")
                for word in ("a", " quill"):
                    event = f"data: {json.dumps({'choices': [{'index': 0, 'delta': {'content': word}}]})}\n\n"
                    conn.sendall(f"{len(event):x}\r\n{event}\r\n".encode())
                if self.clean:
                    conn.sendall(b"0\r\n\r\n")

    @staticmethod
    def read(conn) -> str:
        """The whole request, body included: closing on an unread body would reset the connection instead."""
        data = b""
        while b"\r\n\r\n" not in data:
            data += conn.recv(65536)
        head, _, body = data.partition(b"\r\n\r\n")
        length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                       if line.lower().startswith(b"content-length:")), 0)
        while len(body) < length:
            body += conn.recv(65536)
        return head.decode(errors="replace")

    def close(self):
        self.sock.close()


@pytest.mark.parametrize("clean", [False, True])
def test_a_stream_cut_off_midway_is_an_error_never_a_short_or_repeated_text(tiny_server, clean):
    cut = CutOffServer(clean)

    async def scenario():
        got = []
        async with LLMRouter([cut.url], model="tiny", connect_wait=1) as alone:  # one upstream: the client's path
            with pytest.raises(LLMError, match="broke off before the answer was complete"):
                async for delta in alone.stream_chat(PROMPT, max_tokens=8):
                    got.append(delta)
        assert "".join(got) == "a quill"  # what arrived, once: never retried after text went out
        async with LLMRouter([cut.url, f"{tiny_server.url}/v1"], model="tiny", connect_wait=1) as router:
            for up in router.pool:  # make the cut one the first choice
                up.picks = 1 if up.url != cut.url else 0
            got.clear()
            with pytest.raises(LLMError, match="broke off before the answer was complete"):
                async for delta in router.stream_chat(PROMPT, max_tokens=8):
                    got.append(delta)
            assert "".join(got) == "a quill"
            assert router.pool[0].failures == 1 and router.pool[0].error.startswith("stream broke off")
            # the next one goes to the healthy upstream while the cut one is left out
            text = "".join([d async for d in router.stream_chat(PROMPT, max_tokens=8)])
            assert text and router.pool[1].served == 1

    try:
        asyncio.run(scenario())
    finally:
        cut.close()
