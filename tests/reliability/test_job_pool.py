"""Job workers are a bounded pool: 40 start_pipeline calls through a real MCP server process make at most max_jobs
worker processes at once, the rest wait queued with their positions and then all finish, also after the server that
queued them has exited; a queued job can be cancelled; a client past its queue cap hears the limit and its setting;
an id prefix names no job.

The articles are real pipeline runs in real workers with a real job store; their LLM is the stand-in of
llm_standin.py (answers after 0.3 s), since the point is the workers, not the text."""

import asyncio
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from mcp import Client, StdioServerParameters

from common.procs import cmdline, pid_alive
from common.settings import Settings
from mcp_server.server import build_server
from orchestrator.jobs import JobStore
from tests.backend.server_process import ROOT, free_port
from tests.serving import wait_for

N = 3  # workers at once: below the 40 calls, above 1 so that jobs overlap
CALLS = 40
ARTICLE = {"topic": "marginalia", "sections": 1, "images": 0, "words_per_section": 30}


def environ(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return f.read()
    except OSError:
        return b""


class WorkerCount:
    """Samples the live `python -m orchestrator work ID` processes working for one data directory (their
    SCRIPTORIUM_HOME, so other tests' workers on the machine are not counted), and keeps the largest count."""

    def __init__(self, home: Path):
        self.home = f"SCRIPTORIUM_HOME={home}".encode()
        self.most, self.samples = 0, 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._watch, daemon=True)

    def now(self) -> int:
        count = 0
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            pid = int(entry.name)
            args = cmdline(pid) or []
            if args[-3:-1] == ["orchestrator", "work"] and self.home in environ(pid).split(b"\0") and pid_alive(pid):
                count += 1
        return count

    def _watch(self) -> None:
        while not self.stop.is_set():
            self.most = max(self.most, self.now())
            self.samples += 1
            time.sleep(0.02)

    def __enter__(self) -> "WorkerCount":
        self.thread.start()
        return self

    def __exit__(self, *_) -> None:
        self.stop.set()
        self.thread.join()


@pytest.fixture
def standin():
    """The LLM stand-in as a process; its base URL."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "tests.reliability.llm_standin", "--port", str(port)], cwd=ROOT)
    url = f"http://127.0.0.1:{port}"

    def up() -> bool:
        try:
            return httpx.get(f"{url}/v1/models", timeout=1).status_code == 200
        except httpx.TransportError:
            return False

    wait_for(up, timeout=30)
    yield url
    proc.terminate()
    proc.wait(timeout=10)


def stdio_server(settings: Settings) -> StdioServerParameters:
    env = {**os.environ, "SCRIPTORIUM_HOME": str(settings.home), "SCRIPTORIUM_LLM_URL": settings.llm_urls[0],
           "SCRIPTORIUM_MAX_JOBS": str(N), "SCRIPTORIUM_MAX_QUEUED_PER_CLIENT": str(CALLS)}
    env.pop("SCRIPTORIUM_COMFYUI_URL", None)
    return StdioServerParameters(command=sys.executable, args=["-m", "mcp_server"], cwd=str(ROOT), env=env)


def test_forty_pipelines_run_at_most_n_at_once_and_all_finish(tmp_path, standin):
    settings = Settings(home=tmp_path / "home", llm_urls=(f"{standin}/v1",))

    async def submit():
        async with Client(stdio_server(settings)) as client:
            started = []
            for i in range(CALLS):
                reply = await client.call_tool("start_pipeline", {**ARTICLE, "topic": f"marginalia {i}"})
                started.append(reply.structured_content)
            listed = (await client.call_tool("list_jobs", {"limit": CALLS})).structured_content["jobs"]
            last = started[-1]["job_id"]
            cancelled = (await client.call_tool("cancel_job", {"job_id": last})).structured_content
            return started, listed, cancelled

    # The workers are counted from the first call on; the server exits after its last answer, and the queue
    # must still drain: each worker whose job ends becomes the worker of the next one.
    store = JobStore(settings.jobs_db)
    with WorkerCount(settings.home) as workers:
        started, listed, cancelled = asyncio.run(submit())
        ids = [s["job_id"] for s in started]
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            runs = [store.get(i) for i in ids]  # read only: nothing here starts a job
            if all(r.status in ("done", "failed", "cancelled") for r in runs):
                break
            time.sleep(0.2)
        while workers.now():
            time.sleep(0.05)

    queued = [s for s in started if s["status"] == "queued" and s["queue_position"]]
    assert len(queued) >= CALLS - 2 * N  # a few may have started before the last calls came
    assert all(1 <= s["queue_position"] <= k + 1 for k, s in enumerate(started) if s in queued)
    waiting = sorted((j["queue_position"], j["job_id"]) for j in listed if j["queue_position"])
    assert [p for p, _ in waiting] == list(range(1, len(waiting) + 1)) and len(waiting) >= CALLS // 2
    assert [i for _, i in waiting] == [i for i in ids if i in dict((i, p) for p, i in waiting)]  # in call order

    assert cancelled["status"] == "cancelled" and cancelled["queue_position"] is None
    assert store.steps(ids[-1]) == []  # a queued job that is cancelled never starts
    runs = {i: store.get(i) for i in ids}
    assert {i: r.status for i, r in runs.items() if i != ids[-1]} == {i: "done" for i in ids[:-1]}, \
        {i: r.error for i, r in runs.items() if r.error}
    assert 1 <= workers.most <= N, f"{workers.most} workers alive at once over {workers.samples} samples"
    assert workers.samples > 50
    assert httpx.get(f"{standin}/_test/state").json()["most_in_flight"] <= N  # one request at a time per article

    # Started in the order they were queued: a worker's start shows as its research step starting. Jobs
    # dispatched within the same moment may swap by a process start, never by a round of the pool.
    order = sorted(ids[:-1], key=lambda i: store.step(i, "research").started)
    assert all(abs(order.index(i) - ids.index(i)) <= N for i in ids[:-1]), order


def held(settings: Settings, n: int) -> list[str]:
    """n jobs that hold the pool's places: marked running by this (live) process, as a foreground CLI job is."""
    store = JobStore(settings.jobs_db)
    return [store.create_run("article", {"topic": f"held {i}"}, status="running", client="cli", pid=os.getpid()).id
            for i in range(n)]


@pytest.fixture
def full_pool(tmp_path) -> Settings:
    settings = Settings(home=tmp_path / "home", llm_urls=("http://127.0.0.1:9/v1",), max_jobs=2,
                        max_queued_per_client=3)
    held(settings, 2)
    return settings


def test_a_client_past_its_queue_cap_hears_the_limit_and_the_setting(full_pool):
    async def go():
        async with Client(build_server(full_pool)) as client:
            replies = [await client.call_tool("start_pipeline", ARTICLE) for _ in range(4)]
            info = (await client.call_tool("get_job", {"job_id": replies[1].structured_content["job_id"]}))
            return replies, info.structured_content

    replies, second = asyncio.run(go())
    assert [r.structured_content["queue_position"] for r in replies[:3]] == [1, 2, 3]
    assert all(r.structured_content["status"] == "queued" for r in replies[:3])
    assert second["status"] == "queued" and second["queue_position"] == 2
    refused = replies[3]
    assert refused.is_error
    text = refused.content[0].text
    assert "3 jobs waiting" in text and "max_queued_per_client = 3" in text
    assert "SCRIPTORIUM_MAX_QUEUED_PER_CLIENT" in text


def test_cancelling_a_queued_job_and_ids_that_are_only_prefixes(full_pool):
    async def go():
        async with Client(build_server(full_pool)) as client:
            first, second = [(await client.call_tool("start_pipeline", ARTICLE)).structured_content["job_id"]
                             for _ in range(2)]
            prefixes = [first[:1], first[:8], first[:-1]]
            by_prefix = [await client.call_tool("cancel_job", {"job_id": p}) for p in prefixes]
            got = [await client.call_tool("get_job", {"job_id": p}) for p in prefixes]
            still = (await client.call_tool("get_job", {"job_id": first})).structured_content
            cancelled = (await client.call_tool("cancel_job", {"job_id": first})).structured_content
            moved_up = (await client.call_tool("get_job", {"job_id": second})).structured_content
            return by_prefix, got, still, cancelled, moved_up

    by_prefix, got, still, cancelled, moved_up = asyncio.run(go())
    for reply in (*by_prefix, *got):
        assert reply.is_error and "no job" in reply.content[0].text
    assert still["status"] == "queued" and still["queue_position"] == 1  # untouched by the prefixes
    assert cancelled["status"] == "cancelled" and cancelled["queue_position"] is None
    assert moved_up["queue_position"] == 1


def test_image_jobs_wait_for_a_worker_like_articles(full_pool):
    from orchestrator import api

    queued = [api.start_image({"prompt": f"folio {i}", "steps": 2}, full_pool, client="painter") for i in range(3)]
    assert [(r.status, r.queue_position) for r in queued] == [("queued", 1), ("queued", 2), ("queued", 3)]
    assert not any(r.worker_alive for r in queued)  # no process of their own while the pool is full
    with pytest.raises(api.JobError, match="'painter' already has 3 jobs waiting"):
        api.start_image({"prompt": "one too many", "steps": 2}, full_pool, client="painter")
