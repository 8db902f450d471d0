"""Jobs as agents follow them: list_jobs pages with a cursor, resources/list shows recent jobs, a subscribed
job's changes arrive as notifications/resources/updated, job progress as log messages, and the one prompt."""

import asyncio
import os
import warnings

import pytest
from mcp import Client
from mcp.types import ResourceUpdatedNotification

from common.settings import Settings
from mcp_server.server import build_server
from orchestrator import api
from orchestrator.jobs import JobStore
from tests.backend.server_process import free_port

warnings.filterwarnings("ignore", message=".*deprecated as of 2026-07-28.*")


@pytest.fixture
def settings(tmp_path) -> Settings:
    return Settings(home=tmp_path / "home", llm_urls=(f"http://127.0.0.1:{free_port()}/v1",), mcp_toolsets=("all",))


def queued(settings: Settings, n: int) -> list[str]:
    """Runs in the store that stay queued: each held by this process, as a run whose worker is starting is, so
    listing them does not hand them to workers."""
    ids = [api.create_article_run({"topic": f"topic {i}", "images": 0}, settings).id for i in range(n)]
    for run_id in ids:
        JobStore(settings.jobs_db).update(run_id, pid=os.getpid())
    return ids


def test_list_jobs_pages_with_a_cursor(settings):
    ids = queued(settings, 5)

    async def go():
        async with Client(build_server(settings)) as client:
            seen, cursor, pages = [], None, 0
            while True:
                args = {"limit": 2, **({"cursor": cursor} if cursor else {})}
                page = (await client.call_tool("list_jobs", args)).structured_content
                seen += [j["job_id"] for j in page["jobs"]]
                pages += 1
                cursor = page["next_cursor"]
                if cursor is None:
                    break
            bad = await client.call_tool("list_jobs", {"cursor": "not-a-cursor"})
            return seen, pages, bad

    seen, pages, bad = asyncio.run(go())
    assert seen == list(reversed(ids)) and pages == 3  # newest first, each once
    assert bad.is_error and "start again without a cursor" in bad.content[0].text


def test_resources_list_and_subscriptions(settings):
    (job_id,) = queued(settings, 1)
    updates: list[str] = []

    async def on_message(message):
        if isinstance(message, ResourceUpdatedNotification):
            updates.append(str(message.params.uri))

    async def go():
        async with Client(build_server(settings), mode="legacy", message_handler=on_message) as client:
            listed = (await client.list_resources()).resources
            assert [str(r.uri) for r in listed] == [f"scriptorium://jobs/{job_id}"]
            assert "topic 0" in listed[0].title and listed[0].mime_type == "application/json"
            await client.subscribe_resource(f"scriptorium://jobs/{job_id}")
            await asyncio.sleep(1.5)
            assert updates == []  # nothing changed yet
            await asyncio.to_thread(JobStore(settings.jobs_db).update, job_id, stage="research", progress=0.2)
            for _ in range(50):
                if updates:
                    break
                await asyncio.sleep(0.1)

    asyncio.run(go())
    assert updates[:1] == [f"scriptorium://jobs/{job_id}"]


def test_job_progress_as_log_messages_at_the_chosen_level(settings, comfyui):
    settings = Settings(home=settings.home, llm_urls=settings.llm_urls, comfyui_url=comfyui.url)
    comfyui.behave(hang=True)
    logged: list = []

    async def on_log(params):
        logged.append(params)

    async def go():
        async with Client(build_server(settings, budget=2), mode="legacy", logging_callback=on_log) as client:
            await client.set_logging_level("info")
            first = await client.call_tool("generate_image", {"prompt": "slowly", "steps": 5})
            heard = len(logged)
            await client.set_logging_level("error")
            await client.call_tool("generate_image", {"prompt": "again", "steps": 5})
            for job in (await client.call_tool("list_jobs", {})).structured_content["jobs"]:
                await client.call_tool("cancel_job", {"job_id": job["job_id"]})
            return first.structured_content["job_id"], heard

    job_id, heard = asyncio.run(go())
    comfyui.behave()
    assert heard >= 1 and len(logged) == heard  # nothing below error once the client asked for error
    assert all(p.level == "info" and p.logger == "scriptorium" for p in logged)
    assert any(f"job {job_id}" in str(p.data) for p in logged)


def test_the_write_article_prompt(settings):
    async def go():
        async with Client(build_server(settings)) as client:
            prompts = {p.name: p for p in (await client.list_prompts()).prompts}
            assert set(prompts) == {"write_article", "research_agent", "writing_agent", "image_agent",
                                    "integration_agent"}  # the roles: test_runs.py
            assert {a.name for a in prompts["write_article"].arguments} == {"topic", "audience", "length"}
            got = await client.get_prompt("write_article", {"topic": "marginalia", "length": "short"})
            return got.messages[0].content.text

    text = asyncio.run(go())
    assert "start_pipeline" in text and "'marginalia'" in text and "sections=3" in text and "get_job" in text
