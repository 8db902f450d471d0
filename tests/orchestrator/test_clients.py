"""The LLM and ComfyUI clients against real servers (our backend; the ComfyUI stand-in)."""

import asyncio
import json

import httpx
import pytest

from orchestrator import workflows
from orchestrator.clients.comfyui import ComfyUIClient, ComfyUIError, Interrupted, NodeError
from orchestrator.clients.llm_client import LLMClient, LLMError
from tests.backend.server_process import free_port


def run(coro):
    return asyncio.run(coro)


def sd15(**values) -> dict:
    workflow, defaults = workflows.load("sd15")
    return workflows.fill(workflow, {**defaults, "prompt": "a scribe at a desk", "seed": 1, "steps": 4, **values})


def test_generate_follows_progress_and_downloads_the_png(comfyui):
    events = []

    async def go():
        async with ComfyUIClient(comfyui.url) as client:
            stats = await client.system_stats()
            images = await client.generate(sd15(width=64, height=48), on_progress=events.append)
            await client.free()
            return stats, images

    stats, images = run(go())
    assert stats["devices"][0]["vram_total"] > 0
    assert len(images) == 1 and images[0][:8] == b"\x89PNG\r\n\x1a\n"
    assert [e["value"] for e in events if "value" in e] == [1, 2, 3, 4]
    assert {"path": "/free", "body": {"unload_models": True, "free_memory": True}} in comfyui.calls()


def test_polling_fallback_when_the_websocket_is_unavailable(comfyui, monkeypatch):
    import websockets

    async def refuse(*args, **kwargs):
        raise OSError("websocket refused")

    monkeypatch.setattr(websockets, "connect", refuse)

    async def go():
        async with ComfyUIClient(comfyui.url) as client:
            return await client.generate(sd15())

    assert run(go())[0][:4] == b"\x89PNG"


def test_missing_checkpoint_fails_before_submission_listing_the_available_ones(comfyui):
    async def go():
        async with ComfyUIClient(comfyui.url) as client:
            await client.generate(sd15(checkpoint="dreamshaper_8.safetensors"))

    with pytest.raises(NodeError) as err:
        run(go())
    assert err.value.node_id == "4" and err.value.class_type == "CheckpointLoaderSimple"
    assert "'dreamshaper_8.safetensors' is not available" in str(err.value)
    assert "v1-5-pruned-emaonly.safetensors" in str(err.value)
    assert not any(call["path"] == "/prompt" for call in comfyui.calls())


def test_a_rejected_workflow_names_the_node_and_its_class(comfyui):
    workflow = sd15()
    workflow["3"]["inputs"]["latent_image"] = ["6", 0]  # a CONDITIONING where a LATENT belongs

    async def go():
        async with ComfyUIClient(comfyui.url) as client:
            await client.submit(workflow)

    with pytest.raises(NodeError) as err:
        run(go())
    assert (err.value.node_id, err.value.class_type) == ("3", "KSampler")
    assert "Return type mismatch" in err.value.message


def test_an_execution_error_names_the_node(comfyui):
    comfyui.behave(fail_class="VAEDecode", message="tensor size mismatch")

    async def go():
        async with ComfyUIClient(comfyui.url) as client:
            await client.generate(sd15())

    with pytest.raises(NodeError, match=r"ComfyUI node 8 \(VAEDecode\): tensor size mismatch"):
        run(go())


def test_a_hung_prompt_times_out_naming_the_url(comfyui):
    comfyui.behave(hang=True)

    async def go():
        async with ComfyUIClient(comfyui.url, timeout=1.5) as client:
            await client.generate(sd15())

    with pytest.raises(ComfyUIError, match=f"ComfyUI at {comfyui.url} did not finish prompt .* within 2 s"):
        run(go())


def test_cancelling_a_queued_prompt_drops_it_and_leaves_the_running_one_alone(comfyui):
    """ComfyUI runs one prompt at a time: a bare /interrupt would stop whatever runs, maybe another
    client's prompt. Ours is deleted from the queue and interrupted only if it is the one running."""
    comfyui.behave(hang=True)

    async def go():
        async with ComfyUIClient(comfyui.url) as a, ComfyUIClient(comfyui.url) as b:
            first = asyncio.create_task(a.generate(sd15(seed=1)))
            while not (await a.http.get("/queue")).json()["queue_running"]:
                await asyncio.sleep(0.05)
            with pytest.raises(Interrupted):
                await b.generate(sd15(seed=2), should_stop=lambda: True)
            queue = (await a.http.get("/queue")).json()
            await a.http.post("/_test/behaviour", json={"hang": False})
            return queue, await first

    queue, images = run(go())
    assert len(queue["queue_running"]) == 1 and queue["queue_pending"] == []
    assert len(images) == 1  # the other client's prompt ran to the end
    (cancelled,) = [call["body"]["delete"][0] for call in comfyui.calls() if call["path"] == "/queue"]
    assert httpx.get(f"{comfyui.url}/history/{cancelled}").json() == {}  # never ran


def test_newer_combo_choices_are_checked_before_submission(comfyui):
    """Newer nodes list their choices as ["COMBO", {"options": [...]}], and ComfyUI only finds a missing
    model file when the node runs; we refuse it before submitting."""
    workflow = sd15()
    workflow["20"] = {"class_type": "UpscaleModelLoader", "inputs": {"model_name": "4x-UltraSharp.pth"}}

    async def go():
        async with ComfyUIClient(comfyui.url) as client:
            with pytest.raises(NodeError) as err:
                await client.check_choices(workflow)
            prompt_id = await client.submit(workflow)  # ComfyUI itself accepts it...
            with pytest.raises(NodeError, match="No such file or directory"):
                await client.wait(prompt_id)  # ...and fails at run time
            workflow["20"]["inputs"]["model_name"] = "RealESRGAN_x4plus.pth"
            await client.check_choices(workflow)
            return err.value

    error = run(go())
    assert (error.node_id, error.class_type) == ("20", "UpscaleModelLoader")
    assert "'4x-UltraSharp.pth' is not available in ComfyUI; available: RealESRGAN_x4plus.pth" in error.message


def test_a_resubmitted_workflow_is_answered_from_comfyuis_cache(comfyui):
    """The same workflow again: ComfyUI sends execution_cached and no progress, then the same files."""
    events = []

    async def go():
        async with ComfyUIClient(comfyui.url) as client:
            first = await client.generate(sd15())
            return first, await client.generate(sd15(), on_progress=events.append)

    first, second = run(go())
    assert first == second and len(second) == 1 and events == []


def test_every_invalid_node_is_named_and_a_node_needs_a_class(comfyui):
    workflow = sd15()
    workflow["3"]["inputs"]["latent_image"] = ["6", 0]
    del workflow["8"]["inputs"]["vae"]

    async def go():
        async with ComfyUIClient(comfyui.url) as client:
            with pytest.raises(NodeError) as err:
                await client.submit(workflow)
            with pytest.raises(ComfyUIError, match="workflow node 9 has no class_type"):
                await client.generate({"9": {"inputs": {}}})
            return err.value

    error = run(go())
    assert "Return type mismatch" in error.message and "also node 8 (VAEDecode): Required input is missing: vae" \
        in error.message


def test_unreachable_services_name_their_url():
    port = free_port()

    async def comfy():
        async with ComfyUIClient(f"http://127.0.0.1:{port}") as client:
            await client.system_stats()

    with pytest.raises(ComfyUIError, match=f"cannot reach ComfyUI at http://127.0.0.1:{port}"):
        run(comfy())

    async def llm():
        async with LLMClient(f"http://127.0.0.1:{port}/v1", model="m", max_wait=1.5) as client:
            await client.chat([{"role": "user", "content": "hi"}])

    with pytest.raises(LLMError, match=f"http://127.0.0.1:{port}/v1/chat/completions failed after"):
        run(llm())


def test_llm_client_chat_stream_and_structured_output(llm_server):
    schema = {"type": "object", "properties": {"word": {"type": "string", "maxLength": 12}}, "required": ["word"],
              "additionalProperties": False}

    async def go():
        async with LLMClient(f"{llm_server.url}/v1") as client:
            assert await client.models() == ["tiny", "tiny-qwen"]
            plain = await client.chat([{"role": "user", "content": "Name a colour."}], max_tokens=12, temperature=0)
            streamed = "".join([d async for d in client.stream_chat([{"role": "user", "content": "Name a colour."}],
                                                                    max_tokens=12, temperature=0)])
            structured = await client.chat([{"role": "user", "content": "A word"}], max_tokens=60, json_schema=schema)
            return plain, streamed, structured

    plain, streamed, structured = run(go())
    assert plain["text"] == streamed and plain["usage"]["completion_tokens"] > 0
    assert set(json.loads(structured["text"])) == {"word"}


def test_llm_client_waits_while_the_backend_sleeps(llm_server):
    """503 + Retry-After (the backend lending its memory to ComfyUI) is waited out, not reported."""
    httpx.post(f"{llm_server.url}/sleep", params={"level": 1}).raise_for_status()

    async def go():
        async with LLMClient(f"{llm_server.url}/v1", model="tiny") as client:
            request = asyncio.create_task(client.chat([{"role": "user", "content": "hi"}], max_tokens=4))
            await asyncio.sleep(1.0)
            assert not request.done()
            await asyncio.to_thread(httpx.post, f"{llm_server.url}/wake_up")
            return await request

    try:
        reply = run(go())
    finally:
        httpx.post(f"{llm_server.url}/wake_up")
    assert reply["usage"]["completion_tokens"] > 0


def test_llm_client_does_not_retry_a_client_error(llm_server):
    async def go():
        async with LLMClient(f"{llm_server.url}/v1") as client:
            await client.chat([{"role": "wizard", "content": "hi"}], max_tokens=8)

    with pytest.raises(LLMError, match="answered 400: messages.0..role"):
        run(go())


def test_templates_fill_typed_values_and_refuse_unknown_placeholders(tmp_path):
    for name in workflows.BUILTIN:
        workflow, defaults = workflows.load(name)
        filled = workflows.fill(workflow, {**defaults, "prompt": "ink", "seed": 5, "image": "in.png"})
        assert "{{" not in json.dumps(filled)
    filled = sd15(width=640)
    assert filled["5"]["inputs"]["width"] == 640 and filled["3"]["inputs"]["seed"] == 1
    custom = tmp_path / "mine.json"
    custom.write_text(json.dumps({"1": {"class_type": "SaveImage", "inputs": {"filename_prefix": "art-{{seed}}"}}}))
    workflow, defaults = workflows.load(str(custom))
    assert workflows.fill(workflow, {"seed": 9})["1"]["inputs"]["filename_prefix"] == "art-9"
    custom.write_text(json.dumps({"1": {"class_type": "SaveImage", "inputs": {"x": "{{colour}}"}}}))
    with pytest.raises(workflows.TemplateError, match="unknown placeholder\\(s\\) colour"):
        workflows.load(str(custom))
    custom.write_text(json.dumps({"nodes": [], "links": []}))
    with pytest.raises(workflows.TemplateError, match="not an API-format workflow"):
        workflows.load(str(custom))
    workflow, defaults = workflows.load("sd15")
    with pytest.raises(workflows.TemplateError, match="needs a value for {{prompt}}"):
        workflows.fill(workflow, {**defaults, "seed": 1})
