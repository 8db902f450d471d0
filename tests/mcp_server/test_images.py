"""Image tools against the ComfyUI stand-in: a user's workflow with overrides, uploads, img2img and upscale,
LoRAs and checkpoints checked before submission, and our own prompts in ComfyUI's queue."""

import asyncio
import base64
import io
import json
import time
from pathlib import Path

import pytest
from mcp import Client
from PIL import Image

from common.settings import Settings
from mcp_server.server import build_server
from tests.mcp_server.helpers import Checked, poll_job

SD15 = Path(__file__).resolve().parents[2] / "orchestrator" / "workflows" / "sd15.json"


@pytest.fixture
def allowed(tmp_path) -> Path:
    folder = tmp_path / "work"
    folder.mkdir()
    return folder


@pytest.fixture
def settings(tmp_path, allowed, llm_server, comfyui) -> Settings:
    return Settings(home=tmp_path / "home", llm_urls=(f"{llm_server.url}/v1",), comfyui_url=comfyui.url,
                    mcp_allowed_dirs=(str(allowed),), mcp_toolsets=("images",))


def user_workflow(allowed: Path) -> Path:
    """An API-format export as ComfyUI writes it: literal values, node titles in _meta, no placeholders."""
    workflow = json.loads(SD15.read_text())
    workflow["3"]["inputs"].update(seed=1, steps=4, cfg=7.0)
    workflow["4"]["inputs"]["ckpt_name"] = "v1-5-pruned-emaonly.safetensors"
    workflow["5"]["inputs"].update(width=256, height=192)
    workflow["6"]["inputs"]["text"] = "a scribe"
    workflow["6"]["_meta"] = {"title": "Positive"}
    workflow["7"]["inputs"]["text"] = "blurry"
    path = allowed / "my-workflow.json"
    path.write_text(json.dumps(workflow))
    return path


def size_of(content) -> tuple[int, int]:
    with Image.open(io.BytesIO(base64.b64decode(content.data))) as image:
        return image.size


def test_run_workflow_with_a_user_file_and_overrides(settings, allowed, comfyui):
    path = user_workflow(allowed)

    async def go():
        async with Client(build_server(settings, budget=60)) as client:
            call = Checked(client)
            result = await call("run_workflow", {"workflow": str(path), "overrides": {
                "KSampler.seed": 7, "Positive.text": "an illuminated letter", "5.width": 320}})
            assert not result.is_error, result.content[0].text
            assert result.structured_content["images"], result.structured_content
            (image,) = result.structured_content["images"]
            assert (image["width"], image["height"]) == (320, 192)
            for overrides, expected in (({"Nope.seed": 1}, "no node 'Nope'"), ({"KSampler.sead": 1}, "no input 'sead'"),
                                        ({"CLIPTextEncode.text": "x"}, "names 2 nodes"),
                                        ({"4.ckpt_name": "missing.safetensors"}, "not available in ComfyUI")):
                before = len([c for c in comfyui.calls() if c["path"] == "/prompt"])
                bad = await call("run_workflow", {"workflow": str(path), "overrides": overrides})
                assert bad.is_error and expected in bad.content[0].text, bad.content[0].text
                assert len([c for c in comfyui.calls() if c["path"] == "/prompt"]) == before  # refused before
            outside = await call("run_workflow", {"workflow": str(SD15)})
            assert outside.is_error and "SCRIPTORIUM_MCP_ALLOWED_DIRS" in outside.content[0].text

    asyncio.run(go())


def test_upload_then_img2img_and_upscale(settings, allowed, comfyui):
    Image.new("RGB", (300, 200), (200, 180, 120)).save(allowed / "photo.png")

    async def go():
        async with Client(build_server(settings, budget=60)) as client:
            call = Checked(client)
            first = (await call("upload_image", {"path": str(allowed / "photo.png")})).structured_content
            second = (await call("upload_image", {"path": str(allowed / "photo.png")})).structured_content
            assert first["name"] == "photo.png" and second["name"] == "photo (1).png" and first["type"] == "input"
            assert (comfyui.input_dir / "photo (1).png").read_bytes() == (allowed / "photo.png").read_bytes()
            img2img = await call("generate_image", {"prompt": "as a woodcut", "image": first["name"],
                                                    "denoise": 0.5, "steps": 2})
            assert not img2img.is_error, img2img.content[0].text
            assert img2img.structured_content["images"][0]["width"] == 300  # the input image's size
            job = await poll_job(client, img2img.structured_content["job_id"])
            assert job["status"] == "done"
            upscaled = await call("generate_image", {"prompt": "sharper", "template": "upscale",
                                                     "image": str(allowed / "photo.png")})  # a path: uploaded first
            assert not upscaled.is_error, upscaled.content[0].text
            (big,) = upscaled.structured_content["images"]
            assert (big["width"], big["height"]) == (1200, 800)
            assert max(size_of(upscaled.content[2])) <= 512
            no_image = await call("generate_image", {"prompt": "x", "template": "upscale"})
            assert no_image.is_error and "needs an image" in no_image.content[0].text
            outside = await call("upload_image", {"path": "/etc/hostname"})
            assert outside.is_error and "outside the directories" in outside.content[0].text

    asyncio.run(go())


def test_checkpoint_and_lora_are_checked_before_submission(settings, comfyui):
    async def go():
        async with Client(build_server(settings, budget=60)) as client:
            call = Checked(client)
            ok = await call("generate_image", {"prompt": "a quill", "width": 64, "height": 64, "steps": 2,
                                               "checkpoint": "sd_xl_base_1.0.safetensors",
                                               "lora": "ink-wash.safetensors", "lora_strength": 0.8})
            assert not ok.is_error, ok.content[0].text
            bad = await call("generate_image", {"prompt": "a quill", "lora": "nope.safetensors"})
            assert bad.is_error and "lora_name 'nope.safetensors' is not available" in bad.content[0].text
            assert "ink-wash.safetensors" in bad.content[0].text
            assert [c["valid"] for c in comfyui.calls() if c["path"] == "/prompt"] == [True]

    asyncio.run(go())


def test_queue_shows_and_clears_only_our_prompts(settings, comfyui):
    import httpx

    comfyui.behave(hang=True)
    foreign = json.loads(SD15.read_text().replace('"{{seed}}"', "1").replace('"{{steps}}"', "2")
                         .replace('"{{cfg}}"', "7").replace('"{{width}}"', "64").replace('"{{height}}"', "64")
                         .replace("{{checkpoint}}", "v1-5-pruned-emaonly.safetensors"))
    httpx.post(f"{comfyui.url}/prompt", json={"prompt": foreign, "client_id": "someone-else"}).raise_for_status()

    async def go():
        async with Client(build_server(settings, budget=1)) as client:
            call = Checked(client)
            started = await call("generate_image", {"prompt": "ours", "width": 64, "height": 64, "steps": 2})
            job_id = started.structured_content["job_id"]
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                queue = (await call("comfyui_queue")).structured_content
                if any(p["ours"] for p in queue["prompts"]):
                    break
                await asyncio.sleep(0.1)
            assert queue["running"] == 1 and queue["pending"] == 1
            assert [p["ours"] for p in queue["prompts"]] == [False, True]  # someone else's runs, ours waits
            cleared = (await call("comfyui_queue", {"clear": True})).structured_content
            assert len(cleared["cleared"]) == 1 and cleared["pending"] == 0 and cleared["running"] == 1
            assert (await poll_job(client, job_id, timeout=20))["status"] == "cancelled"

    asyncio.run(go())
    comfyui.behave()
