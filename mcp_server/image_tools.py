"""Image tools over ComfyUI: generate_image, run_workflow, upload_image, list_image_models, comfyui_queue and
free_image_memory. Renders run as jobs; a call returns the images (resource links and small thumbnails) when
they are done within the budget, else the job id."""

import asyncio
import base64
import time
from pathlib import Path
from typing import Annotated

import anyio
from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from mcp.types import CallToolResult, ImageContent, ResourceLink, TextContent
from pydantic import Field

from mcp_server.job_tools import FINAL, cancel_and_settle, job_info
from mcp_server.lazy import lazy
from mcp_server.logs import log
from mcp_server.models import (
    FreedMemory,
    ImageFile,
    ImageModels,
    ImageResult,
    Memory,
    QueuedPrompt,
    QueueInfo,
    Uploaded,
)
from mcp_server.thumbnails import thumbnail
from mcp_server.tool_context import (
    CREATES,
    DESTRUCTIVE,
    READ_ONLY,
    Roots,
    checked_file,
    client_name,
    comfyui_url,
    state_of,
)
from orchestrator import workflows
from orchestrator.clients.comfyui import ComfyUIClient, ComfyUIError

api = lazy("orchestrator.api")  # the pipelines load on the first tool call

Dimension = Annotated[int | None, Field(ge=64, le=2048, multiple_of=8)]


async def follow(ctx: Context, run):
    """The job once final, or as it stands when the budget runs out; progress is reported and sent as log
    messages. A cancelled call (the client gave up, or the session ended) cancels the job."""
    state = state_of(ctx)
    deadline = time.monotonic() + state.budget
    said: tuple = ()
    try:
        while time.monotonic() < deadline:
            run = await asyncio.to_thread(api.get, run.id, state.settings)
            if run.status in FINAL or run.interrupted:  # a worker that died will not finish it
                return run
            await ctx.report_progress(run.progress, 1.0, run.message or run.status)
            if (run.status, run.stage, run.message) != said:
                said = (run.status, run.stage, run.message)
                await log(ctx, "info", f"job {run.id}: {run.message or run.stage or run.status}")
            await asyncio.sleep(0.25)
        return run
    except anyio.get_cancelled_exc_class():
        with anyio.CancelScope(shield=True):
            await cancel_and_settle(run.id, ctx)
        raise


def image_result(run) -> CallToolResult:
    info = job_info(run)
    if run.status == "failed":
        raise ToolError(f"Image generation failed: {run.error}")
    if run.status == "cancelled":
        raise ToolError(f"job {run.id} was cancelled")
    if run.status != "done":
        info.message = "still rendering: call get_job with this job_id until its status is done"
        result = ImageResult(**info.model_dump())
        return CallToolResult(content=[TextContent(type="text", text=result.model_dump_json())],
                              structured_content=result.model_dump(mode="json"))
    content, files = [], []
    for path in run.result["images"]:
        data = Path(path).read_bytes()
        small = thumbnail(data)
        uri = f"scriptorium://jobs/{run.id}/images/{Path(path).name}"
        files.append(ImageFile(path=path, uri=uri, width=small.width, height=small.height, bytes=len(data)))
        content.append(ResourceLink(type="resource_link", uri=uri, name=Path(path).name, mime_type="image/png",
                                    size=len(data), description=f"{small.width}x{small.height} PNG, saved at {path}"))
        content.append(ImageContent(type="image", data=_b64(small.data), mime_type=small.mime_type))
    text = f"Saved {', '.join(run.result['images'])} (thumbnails below; read the resource links for full size)"
    result = ImageResult(**info.model_dump(), images=files)
    return CallToolResult(content=[TextContent(type="text", text=text), *content],
                          structured_content=result.model_dump(mode="json"))


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


async def start_and_follow(ctx: Context, params: dict) -> CallToolResult:
    """Validate the workflow against ComfyUI before anything is queued, then run it as a job and follow it."""
    state = state_of(ctx)
    url = comfyui_url(ctx)
    try:
        workflow = api.image_workflow(params)
        async with ComfyUIClient(url) as comfy:
            await comfy.check_choices(workflow)
        run = await asyncio.to_thread(api.start_image, params, state.settings, client_name(ctx))
    except (api.ParamsError, api.TemplateError, api.JobError, ComfyUIError) as e:
        raise ToolError(str(e)) from None
    return image_result(await follow(ctx, run))


async def uploaded(ctx: Context, roots, image: str | None) -> str | None:
    """An image argument as a name in ComfyUI's input folder: a local path (with a /) is uploaded first."""
    if image is None or ("/" not in image and "\\" not in image and not image.startswith("~")):
        return image
    path = checked_file(ctx, roots, image, "image")
    async with ComfyUIClient(comfyui_url(ctx)) as comfy:
        return (await comfy.upload_image(Path(path).read_bytes(), Path(path).name))["name"]


def register(server: MCPServer) -> None:
    @server.tool(title="Generate an image", annotations=CREATES)
    async def generate_image(
        prompt: Annotated[str, Field(min_length=1, description="what the picture shows")],
        ctx: Context,
        negative_prompt: Annotated[str | None, Field(description="what to avoid")] = None,
        width: Dimension = None,
        height: Dimension = None,
        steps: Annotated[int | None, Field(ge=1, le=150)] = None,
        seed: Annotated[int | None, Field(ge=0)] = None,
        checkpoint: Annotated[str | None, Field(description="a checkpoint from list_image_models")] = None,
        lora: Annotated[str | None, Field(description="a LoRA from list_image_models")] = None,
        lora_strength: Annotated[float, Field(ge=-4, le=4)] = 1.0,
        image: Annotated[str | None, Field(description="input image for img2img/upscale: a name upload_image "
                                                       "returned, or a file path")] = None,
        denoise: Annotated[float | None, Field(gt=0, le=1, description="img2img: how much to change (0-1)")] = None,
        template: Annotated[str, Field(description="sd15, sdxl, flux, img2img, upscale, or an API-format "
                                                   "workflow file")] = "sd15",
        roots: Roots = None,
    ) -> Annotated[CallToolResult, ImageResult]:
        """Text to image with ComfyUI (with `image`: image to image). Returns resource links and thumbnails, or a
        job_id for get_job when it outlasts the time budget."""
        if template not in workflows.BUILTIN:
            template = checked_file(ctx, roots, template, "template")
        image = await uploaded(ctx, roots, image)
        if image and template == "sd15":
            template = "img2img"
        params = {"prompt": prompt, "negative_prompt": negative_prompt, "width": width, "height": height,
                  "steps": steps, "seed": seed, "template": template, "checkpoint": checkpoint, "lora": lora,
                  "lora_strength": lora_strength, "image": image, "denoise": denoise}
        return await start_and_follow(ctx, params)

    @server.tool(title="Run a ComfyUI workflow", annotations=CREATES)
    async def run_workflow(
        workflow: Annotated[str, Field(description="path of an API-format workflow JSON ('Save (API)' in ComfyUI) "
                                                   "inside the allowed directories")],
        ctx: Context,
        overrides: Annotated[dict[str, str | int | float | bool], Field(
            description="values by placeholder name (prompt, seed, ...) or '<node>.<input>' with the node's id, "
                        "title or class, e.g. {'KSampler.seed': 7, '6.text': 'a quill'}")] = {},  # noqa: B006
        roots: Roots = None,
    ) -> Annotated[CallToolResult, ImageResult]:
        """Run your own ComfyUI workflow file with named overrides; checked against ComfyUI's nodes and model
        files before it is queued. Returns the images like generate_image."""
        path = checked_file(ctx, roots, workflow, "workflow")
        return await start_and_follow(ctx, {"template": path, "overrides": dict(overrides)})

    @server.tool(title="Upload an image to ComfyUI", annotations=CREATES)
    async def upload_image(
        path: Annotated[str, Field(description="a PNG/JPEG/WebP file inside the allowed directories")],
        ctx: Context,
        overwrite: bool = False,
        roots: Roots = None,
    ) -> Uploaded:
        """Copy a local image into ComfyUI's input folder; pass the returned name as generate_image's image."""
        file = Path(checked_file(ctx, roots, path, "image"))
        if not file.is_file():
            raise ToolError(f"image {path!r} does not exist")
        try:
            async with ComfyUIClient(comfyui_url(ctx)) as comfy:
                answer = await comfy.upload_image(file.read_bytes(), file.name, overwrite)
        except ComfyUIError as e:
            raise ToolError(str(e)) from None
        return Uploaded(name=answer["name"], subfolder=answer.get("subfolder", ""), type=answer.get("type", "input"))

    @server.tool(title="List image models", annotations=READ_ONLY)
    async def list_image_models(ctx: Context) -> ImageModels:
        """The checkpoints, LoRAs, VAEs and upscale models ComfyUI has, and the built-in templates."""
        try:
            async with ComfyUIClient(comfyui_url(ctx)) as comfy:
                files = await comfy.model_files()
        except ComfyUIError as e:
            raise ToolError(str(e)) from None
        return ImageModels(**files, templates=list(workflows.BUILTIN))

    @server.tool(title="ComfyUI queue", annotations=DESTRUCTIVE)
    async def comfyui_queue(
        ctx: Context,
        clear: Annotated[bool, Field(description="drop our pending prompts and interrupt our running one (their "
                                                 "jobs are cancelled); other clients' prompts are never touched")]
        = False,
    ) -> QueueInfo:
        """What ComfyUI is rendering and has queued, marking the prompts this stack submitted; clear=true
        removes ours."""
        try:
            async with ComfyUIClient(comfyui_url(ctx)) as comfy:
                queue = await comfy.queue()
                prompts, jobs = _prompts(queue)
                cleared = []
                if clear:
                    for p in prompts:
                        if p.ours:
                            await comfy.cancel(p.prompt_id)
                            cleared.append(p.prompt_id)
                    for job in jobs:
                        await asyncio.to_thread(api.cancel, job, state_of(ctx).settings)
                    prompts, _ = _prompts(await comfy.queue())
        except (ComfyUIError, api.JobError) as e:
            raise ToolError(str(e)) from None
        return QueueInfo(running=sum(p.state == "running" for p in prompts),
                         pending=sum(p.state == "pending" for p in prompts), prompts=prompts, cleared=cleared)

    @server.tool(title="Free image memory", annotations=CREATES)
    async def free_image_memory(ctx: Context) -> FreedMemory:
        """Ask ComfyUI to unload its models and free its cached memory; reports VRAM before and after."""
        try:
            async with ComfyUIClient(comfyui_url(ctx)) as comfy:
                before = _memory(await comfy.system_stats())
                await comfy.free(unload_models=True, free_memory=True)
                after = await _settled_memory(comfy, before)
        except ComfyUIError as e:
            raise ToolError(str(e)) from None
        freed = sum(a.vram_free - b.vram_free for a, b in zip(after, before))
        return FreedMemory(before=before, after=after, freed=freed)


def _prompts(queue: dict) -> tuple[list[QueuedPrompt], list[str]]:
    prompts, jobs = [], []
    for state, key in (("running", "queue_running"), ("pending", "queue_pending")):
        for item in queue.get(key, []):
            extra = item[3] if len(item) > 3 and isinstance(item[3], dict) else {}
            ours = bool(extra.get("scriptorium"))
            prompts.append(QueuedPrompt(prompt_id=str(item[1]), state=state, ours=ours))
            if ours and extra.get("scriptorium_job"):
                jobs.append(str(extra["scriptorium_job"]))
    return prompts, jobs


def _memory(stats: dict) -> list[Memory]:
    return [Memory(vram_total=int(d.get("vram_total", 0)), vram_free=int(d.get("vram_free", 0)))
            for d in stats.get("devices", [])]


async def _settled_memory(comfy: ComfyUIClient, before: list[Memory], timeout: float = 10.0) -> list[Memory]:
    """ComfyUI's /free only sets a flag: poll until the free memory has grown and holds still, or timeout."""
    deadline = time.monotonic() + timeout
    last = before
    while time.monotonic() < deadline:
        await asyncio.sleep(0.25)
        now = _memory(await comfy.system_stats())
        grew = sum(m.vram_free for m in now) > sum(m.vram_free for m in before)
        if grew and now == last:
            return now
        last = now
    return last
