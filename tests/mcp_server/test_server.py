"""The MCP server through the SDK's clients: in memory, over stdio and over streamable HTTP."""

import asyncio
import os
import sys
import time

import pytest
from mcp import Client, ClientSession, StdioServerParameters, stdio_client

from mcp_server.server import build_server
from orchestrator.clients.llm import LLMRouter
from orchestrator.settings import Settings
from tests.backend.server_process import ROOT, ServerProcess, free_port

TOOLS = {"generate_text", "chat", "generate_image", "start_pipeline", "get_job", "cancel_job", "list_jobs",
         "list_models", "stack_status"}


def run(coro):
    return asyncio.run(coro)


@pytest.fixture
def settings(tmp_path, llm_server, comfyui) -> Settings:
    return Settings(home=tmp_path / "home", llm_urls=(f"{llm_server.url}/v1",), comfyui_url=comfyui.url)


async def poll_job(client: Client, job_id: str, timeout: float = 180) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        info = (await client.call_tool("get_job", {"job_id": job_id})).structured_content
        if info["status"] in ("done", "failed", "cancelled"):
            return info
        await asyncio.sleep(0.3)
    raise TimeoutError(job_id)


def test_every_tool_in_memory(settings):
    async def go():
        async with Client(build_server(settings, budget=60)) as client:
            tools = {t.name: t for t in (await client.list_tools()).tools}
            assert set(tools) == TOOLS
            assert all(t.description for t in tools.values())
            assert tools["generate_text"].input_schema["properties"]["max_tokens"]["maximum"] == 8192
            assert tools["generate_image"].input_schema["properties"]["width"]["anyOf"][0]["multipleOf"] == 8

            progress = []

            async def on_progress(value, total, message):
                progress.append((value, total))

            text = await client.call_tool("generate_text", {"prompt": "Write about ink.", "max_tokens": 40,
                                                            "temperature": 0}, progress_callback=on_progress)
            assert not text.is_error and text.structured_content["text"] and not text.structured_content["truncated"]
            assert progress and all(total == 40 for _, total in progress)
            reply = await client.call_tool("chat", {"messages": [{"role": "user", "content": "Hi"}],
                                                    "max_tokens": 8, "temperature": 0})
            assert reply.structured_content["tokens"] > 0

            image = await client.call_tool("generate_image", {"prompt": "a quill", "width": 64, "height": 64,
                                                              "steps": 3, "seed": 1})
            assert not image.is_error and [c.type for c in image.content] == ["text", "image"]
            assert image.content[1].mime_type == "image/png"
            path = image.structured_content["paths"][0]
            assert os.path.exists(path) and image.structured_content["status"] == "done"

            started = await client.call_tool("start_pipeline", {"topic": "wax seals", "sections": 1, "images": 1,
                                                                "words_per_section": 40})
            job = await poll_job(client, started.structured_content["job_id"])
            assert job["status"] == "done" and job["result"]["excerpt"] is not None
            md = await client.read_resource(f"scriptorium://jobs/{job['job_id']}/article.md")
            assert md.contents[0].text.startswith("# ")
            name = os.path.basename(job["result"]["images"][0])
            png = await client.read_resource(f"scriptorium://jobs/{job['job_id']}/images/{name}")
            assert png.contents[0].mime_type == "image/png" and png.contents[0].blob

            listed = (await client.call_tool("list_jobs", {})).structured_content["jobs"]
            assert {j["kind"] for j in listed} == {"image", "article"}
            cancelled = await client.call_tool("cancel_job", {"job_id": job["job_id"]})
            assert cancelled.structured_content["status"] == "done"  # a finished job stays finished
            models = (await client.call_tool("list_models", {})).structured_content
            assert [m["id"] for m in models["models"]] == ["tiny"]
            status = (await client.call_tool("stack_status", {})).structured_content
            assert status["llm"][0]["healthy"] and status["comfyui"]["healthy"]
            missing = await client.call_tool("get_job", {"job_id": "nope"})
            assert missing.is_error and "no run 'nope'" in missing.content[0].text

    run(go())


def test_a_slow_image_returns_a_job_id_that_later_completes(settings, comfyui):
    comfyui.behave(hang=True)

    async def go():
        async with Client(build_server(settings, budget=2)) as client:
            started = time.monotonic()
            result = await client.call_tool("generate_image", {"prompt": "a slow scribe", "steps": 3})
            assert time.monotonic() - started < 10
            info = result.structured_content
            assert info["status"] in ("queued", "running") and "get_job" in info["message"]
            comfyui.behave()
            done = await poll_job(client, info["job_id"])
            assert done["status"] == "done" and len(done["result"]["images"]) == 1
            name = os.path.basename(done["result"]["images"][0])
            png = await client.read_resource(f"scriptorium://jobs/{info['job_id']}/images/{name}")
            assert png.contents[0].blob

    run(go())


def test_upstream_down_then_up_and_the_server_keeps_serving(tmp_path, llm_server):
    from tests.backend.tiny_models import build_model

    port = free_port()
    settings = Settings(home=tmp_path / "home", llm_urls=(f"http://127.0.0.1:{port}/v1",), comfyui_url=None)
    model = build_model("llama", tmp_path / "m")

    async def go():
        async with Client(build_server(settings, budget=3)) as client:
            down = await client.call_tool("generate_text", {"prompt": "hi", "max_tokens": 4})
            assert down.is_error and f"127.0.0.1:{port}" in down.content[0].text and "ops up" in down.content[0].text
            image = await client.call_tool("generate_image", {"prompt": "x"})
            assert image.is_error and "ComfyUI is not configured" in image.content[0].text
            server = await asyncio.to_thread(ServerProcess, str(model), port=port)
            try:
                up = await client.call_tool("generate_text", {"prompt": "hi", "max_tokens": 4, "temperature": 0})
                assert not up.is_error and up.structured_content["tokens"] > 0
            finally:
                await asyncio.to_thread(server.stop)

    run(go())


def test_router_fails_over_to_the_next_upstream(llm_server):
    dead = f"http://127.0.0.1:{free_port()}/v1"

    async def go():
        async with LLMRouter([dead, f"{llm_server.url}/v1"], max_wait=5) as router:
            reply = await router.chat([{"role": "user", "content": "hi"}], max_tokens=4)
            assert reply["usage"]["completion_tokens"] > 0
            rows = await router.upstreams()
            assert [r["healthy"] for r in rows] == [False, True]
            routed = await router.chat([{"role": "user", "content": "hi"}], model="tiny", max_tokens=4)
            assert routed["text"] is not None
            with pytest.raises(Exception, match="no upstream serves model 'gpt-9'; available: tiny"):
                await router.chat([{"role": "user", "content": "hi"}], model="gpt-9")

    run(go())


def child_env(settings: Settings, **extra) -> dict:
    return {**os.environ, "SCRIPTORIUM_HOME": str(settings.home), "SCRIPTORIUM_LLM_URL": settings.llm_urls[0],
            "SCRIPTORIUM_COMFYUI_URL": settings.comfyui_url or "", **extra}


def test_stdio_session(settings):
    params = StdioServerParameters(command=sys.executable, args=["-m", "mcp_server"], cwd=str(ROOT),
                                   env=child_env(settings))

    async def go():
        async with stdio_client(params) as (read, write), ClientSession(read, write) as session:
            init = await session.initialize()
            assert init.server_info.name == "scriptorium"
            assert {t.name for t in (await session.list_tools()).tools} == TOOLS
            result = await session.call_tool("generate_text", {"prompt": "Name a colour.", "max_tokens": 8,
                                                               "temperature": 0})
            assert not result.is_error and result.structured_content["tokens"] > 0

    run(go())
