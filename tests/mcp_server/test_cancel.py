"""Cancelling cancels: a tool call the client gives up on, and cancel_job, stop the job, drop or interrupt its
ComfyUI prompt by id, and abort the LLM requests in flight."""

import asyncio
import os
import re
import sys
import time

import httpx
import pytest
from mcp import Client, StdioServerParameters

from common.settings import Settings
from mcp_server.server import build_server
from tests.backend.server_process import ROOT
from tests.mcp_server.helpers import poll_job
from tests.reliability.server_state import metrics


@pytest.fixture
def settings(tmp_path, llm_server, comfyui) -> Settings:
    return Settings(home=tmp_path / "home", llm_urls=(f"{llm_server.url}/v1",), comfyui_url=comfyui.url)


def nothing_left(comfyui, timeout: float = 10) -> dict:
    """ComfyUI's queue once it is empty (or as it is at the timeout)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        queue = comfyui.queue()
        if not queue["queue_running"] and not queue["queue_pending"]:
            return queue
        time.sleep(0.1)
    return queue


def interrupted_prompts(comfyui) -> list[str]:
    return [c["body"].get("prompt_id") for c in comfyui.calls() if c["path"] == "/interrupt"]


def wait_running(comfyui, timeout: float = 30) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        running = comfyui.queue()["queue_running"]
        if running:
            return running[0][1]
        time.sleep(0.1)
    raise TimeoutError("no prompt started")


def stdio(settings: Settings) -> StdioServerParameters:
    env = {**os.environ, "SCRIPTORIUM_HOME": str(settings.home), "SCRIPTORIUM_LLM_URL": settings.llm_urls[0],
           "SCRIPTORIUM_COMFYUI_URL": settings.comfyui_url}
    return StdioServerParameters(command=sys.executable, args=["-m", "mcp_server"], cwd=str(ROOT), env=env)


@pytest.mark.parametrize("transport", ["memory", "stdio"])
def test_a_cancelled_generate_image_leaves_nothing_running(settings, comfyui, transport):
    comfyui.behave(hang=True)
    target = build_server(settings, budget=60) if transport == "memory" else stdio(settings)

    async def scenario():
        async with Client(target, mode="legacy") as client:
            # notifications/cancelled, as today's clients send when their user presses stop
            task = asyncio.ensure_future(client.call_tool("generate_image", {"prompt": "never", "steps": 50}))
            prompt_id = await asyncio.to_thread(wait_running, comfyui)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            queue = await asyncio.to_thread(nothing_left, comfyui)
            jobs = (await client.call_tool("list_jobs", {})).structured_content["jobs"]
            return prompt_id, queue, jobs

    prompt_id, queue, jobs = asyncio.run(scenario())
    assert not queue["queue_running"] and not queue["queue_pending"]
    assert prompt_id in interrupted_prompts(comfyui)  # by its id: another client's render would go on
    assert [j["status"] for j in jobs] == ["cancelled"]


def test_cancel_job_stops_an_image_and_an_article_mid_render(settings, comfyui):
    comfyui.behave(hang=True)

    async def go():
        async with Client(build_server(settings, budget=1)) as client:
            image = (await client.call_tool("generate_image", {"prompt": "slow", "steps": 20})).structured_content
            first = await asyncio.to_thread(wait_running, comfyui)
            cancelled = (await client.call_tool("cancel_job", {"job_id": image["job_id"]})).structured_content
            assert cancelled["status"] == "cancelled"
            assert not (await asyncio.to_thread(nothing_left, comfyui))["queue_running"]
            article = await client.call_tool("start_pipeline", {"topic": "quills", "sections": 1, "images": 1,
                                                                "words_per_section": 30})
            job_id = article.structured_content["job_id"]
            second = await asyncio.to_thread(wait_running, comfyui, 120)
            started = time.monotonic()
            info = (await client.call_tool("cancel_job", {"job_id": job_id})).structured_content
            assert info["status"] == "cancelled" and time.monotonic() - started < 5
            queue = await asyncio.to_thread(nothing_left, comfyui)
            assert not queue["queue_running"] and not queue["queue_pending"]
            return first, second

    first, second = asyncio.run(go())
    assert {first, second} <= set(interrupted_prompts(comfyui))


def aborted(llm_server) -> float:
    text = httpx.get(f"{llm_server.url}/metrics").text
    return sum(float(v) for v in re.findall(r'^scriptorium_requests_total\{model="[^"]+",outcome="abort"\} (\S+)$',
                                            text, re.M))


def running(llm_server) -> float:
    """Requests running on the backend, all its models together."""
    return metrics(llm_server.url).get("scriptorium_requests_running", 0.0)


async def in_flight(llm_server, job, timeout: float = 30) -> bool:
    """Whether the backend runs a request of the article (a section being written) while the job is still
    writing: a fixed pause would race the tiny model, which on the CPU kernels writes a whole section in about a
    second."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if await asyncio.to_thread(running, llm_server):
            return True
        info = await job()
        if info["stage"] != "writing" or info["status"] != "running":
            return False
        await asyncio.sleep(0.02)
    return False


def test_cancel_job_aborts_the_llm_requests_of_an_article(settings, llm_server):
    async def go() -> tuple[dict | None, float]:
        """The cancelled job and the backend's aborts just before the cancel; None for the job when no request of
        it was seen in flight before the cancel (the random model may sample its end tokens early, and a section
        may end between being seen and the cancel: then the job is done, or cancelled with nothing to abort)."""
        async with Client(build_server(settings, budget=5)) as client:
            started = await client.call_tool("start_pipeline", {"topic": "long scrolls", "sections": 2, "images": 0,
                                                                "words_per_section": 1500})
            job_id = started.structured_content["job_id"]

            async def job() -> dict:
                return (await client.call_tool("get_job", {"job_id": job_id})).structured_content

            deadline = time.monotonic() + 60
            while (info := await job())["stage"] != "writing":
                assert time.monotonic() < deadline and info["status"] != "failed", info
                if info["status"] == "done":
                    return None, aborted(llm_server)
                await asyncio.sleep(0.05)
            caught = await in_flight(llm_server, job)  # the sections are being written
            before = aborted(llm_server)
            clock = time.monotonic()
            info = (await client.call_tool("cancel_job", {"job_id": job_id})).structured_content
            assert info["status"] in ("cancelled", "done") and time.monotonic() - clock < 5, info
            final = await poll_job(client, job_id)
            return (final if caught and info["status"] == "cancelled" else None), before

    # Five tries to catch a request in flight; between them, the backend finishes or aborts what the last one left
    # (an abort is counted up to half a second after the job says cancelled), so no try counts another's.
    caught = aborts_seen = False
    for _ in range(5):
        deadline = time.monotonic() + 30
        while running(llm_server) and time.monotonic() < deadline:
            time.sleep(0.1)
        job, before = asyncio.run(go())
        if job is None:
            continue
        caught = True
        assert job["status"] == "cancelled", job
        deadline = time.monotonic() + 10
        while aborted(llm_server) < before + 1 and time.monotonic() < deadline:
            time.sleep(0.2)
        if aborted(llm_server) >= before + 1:  # the backend saw its requests go and aborted them
            aborts_seen = True
            break
    assert caught, "no try caught a request of the article in flight"
    assert aborts_seen, "the backend aborted no request of a cancelled article"
