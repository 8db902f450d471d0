"""The MCP server through the SDK's clients: in memory, over stdio and over streamable HTTP."""

import asyncio
import base64
import io
import os
import sys
import time

import httpx
import pytest
from mcp import Client, ClientSession, StdioServerParameters, stdio_client
from PIL import Image

from common.settings import Settings
from mcp_server.server import build_server
from orchestrator.clients.router import LLMRouter
from tests.backend.server_process import ROOT, ServerProcess, free_port
from tests.mcp_server.helpers import DESTRUCTIVE, READ_ONLY, RUN_TOOLS, TOOLS, Checked, poll_job


def run(coro):
    return asyncio.run(coro)


@pytest.fixture
def settings(tmp_path, llm_server, comfyui) -> Settings:
    return Settings(home=tmp_path / "home", llm_urls=(f"{llm_server.url}/v1",), comfyui_url=comfyui.url,
                    mcp_toolsets=("all",))


def test_every_tool_in_memory_meets_its_output_schema(settings):
    async def go():
        async with Client(build_server(settings, budget=60)) as client:
            call = Checked(client)
            init = client.session.server_info if hasattr(client.session, "server_info") else None
            tools = {t.name: t for t in (await client.list_tools()).tools}
            assert set(tools) == TOOLS
            for name, tool in tools.items():
                assert tool.description and tool.title and tool.output_schema, name
                hints = tool.annotations
                assert hints.open_world_hint is False, name
                assert hints.read_only_hint is (name in READ_ONLY), name
                assert hints.destructive_hint is (name in DESTRUCTIVE), name
            assert tools["generate_text"].input_schema["properties"]["max_tokens"]["maximum"] == 8192
            assert tools["generate_image"].input_schema["properties"]["width"]["anyOf"][0]["multipleOf"] == 8
            assert "roots" not in tools["start_pipeline"].input_schema["properties"]  # filled by the SDK

            progress = []

            async def on_progress(value, total, message):
                progress.append((value, total))

            text = await call("generate_text", {"prompt": "Write about ink.", "max_tokens": 40, "temperature": 0},
                              progress_callback=on_progress)
            result = text.structured_content
            assert not text.is_error and result["text"] and result["finish_reason"] in ("stop", "length")
            assert result["truncated"] == (result["finish_reason"] == "length")  # max_tokens cut it, or not
            cut = (await call("generate_text", {"prompt": "Write about ink.", "max_tokens": 2})).structured_content
            assert cut["truncated"] and cut["finish_reason"] == "length" and cut["tokens"] <= 2
            assert progress and all(total == 40 for _, total in progress)
            reply = await call("chat", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8,
                                        "temperature": 0})
            assert reply.structured_content["tokens"] > 0

            image = await call("generate_image", {"prompt": "a quill", "width": 1024, "height": 640, "steps": 3,
                                                  "seed": 1})
            assert not image.is_error and [c.type for c in image.content] == ["text", "resource_link", "image"]
            link, thumb = image.content[1], image.content[2]
            (saved,) = image.structured_content["images"]
            assert (saved["width"], saved["height"]) == (1024, 640) and link.uri == saved["uri"]
            with Image.open(io.BytesIO(base64.b64decode(thumb.data))) as small:
                assert max(small.size) <= 512 and small.size == (512, 320)
            full = await client.read_resource(link.uri)
            assert len(full.contents[0].blob) > len(thumb.data) // 2 and os.path.exists(saved["path"])

            started = await call("start_pipeline", {"topic": "wax seals", "sections": 1, "images": 1,
                                                    "words_per_section": 40})
            job = await poll_job(client, started.structured_content["job_id"])
            assert job["status"] == "done" and job["result"]["excerpt"] is not None
            done = await call("get_job", {"job_id": job["job_id"]})
            assert done.structured_content["result"]["title"]
            md = await client.read_resource(f"scriptorium://jobs/{job['job_id']}/article.md")
            assert md.contents[0].text.startswith("# ")

            listed = (await call("list_jobs", {})).structured_content["jobs"]
            assert {j["kind"] for j in listed} == {"image", "article"}
            cancelled = await call("cancel_job", {"job_id": job["job_id"]})
            assert cancelled.structured_content["status"] == "done"  # a finished job stays finished
            models = (await call("list_models")).structured_content  # a server of two models lists both
            assert [m["id"] for m in models["models"]] == ["tiny", "tiny-qwen"]
            assert {m["upstream"] for m in models["models"]} == {settings.llm_urls[0]}
            other = await call("generate_text", {"prompt": "Hi", "max_tokens": 6, "temperature": 0,
                                                 "model": "tiny-qwen"})  # loaded on this first use
            assert not other.is_error and other.structured_content["model"] == "tiny-qwen"
            assert other.structured_content["tokens"] > 0
            cards = {m["id"]: m for m in httpx.get(f"{settings.llm_urls[0]}/models").json()["data"]}
            assert cards["tiny-qwen"]["status"] == "loaded" and cards["tiny-qwen"]["loads"] == 1  # it answered
            status = (await call("stack_status")).structured_content
            assert status["llm"][0]["healthy"] and status["comfyui"]["healthy"]
            llm = status["llm"][0]  # what the router knows: in flight now, answered, last failure
            assert llm["in_flight"] == 0 and llm["served"] >= 1 and llm["last_failure"] is None
            image_models = (await call("list_image_models")).structured_content
            assert "v1-5-pruned-emaonly.safetensors" in image_models["checkpoints"] and image_models["loras"]
            assert (await call("comfyui_queue")).structured_content["running"] == 0
            freed = (await call("free_image_memory")).structured_content
            assert freed["freed"] > 0 and freed["after"][0]["vram_free"] > freed["before"][0]["vram_free"]
            missing = await call("get_job", {"job_id": "nope"})
            assert missing.is_error and "no job 'nope'" in missing.content[0].text
            assert "list_jobs" in missing.content[0].text
            # run_workflow and upload_image: test_images.py; the shared-run tools: test_runs.py
            assert call.validated == TOOLS - {"run_workflow", "upload_image"} - RUN_TOOLS
            assert init is None or init.version

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
        async with Client(build_server(settings, budget=30)) as client:
            for tool, args in (("generate_text", {"prompt": "hi", "max_tokens": 4}), ("list_models", {})):
                started = time.monotonic()
                down = await client.call_tool(tool, args)
                assert time.monotonic() - started < 2, f"{tool} took {time.monotonic() - started:.1f} s to fail"
                assert down.is_error and f"127.0.0.1:{port}" in down.content[0].text
                assert "ops up" in down.content[0].text
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
    params = StdioServerParameters(command=sys.executable, args=["-m", "mcp_server", "--toolsets", "all"],
                                   cwd=str(ROOT), env=child_env(settings))

    async def go():
        async with stdio_client(params) as (read, write), ClientSession(read, write) as session:
            init = await session.initialize()
            assert init.server_info.name == "scriptorium" and init.server_info.version
            assert init.capabilities.logging is not None and init.capabilities.resources.subscribe
            assert {t.name for t in (await session.list_tools()).tools} == TOOLS
            result = await session.call_tool("generate_text", {"prompt": "Name a colour.", "max_tokens": 8,
                                                               "temperature": 0})
            assert not result.is_error and result.structured_content["tokens"] > 0

    run(go())
