"""The MCP tool surface: text, images, pipeline jobs, models and stack status for agents."""

import asyncio
import base64
import json
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Literal

from mcp.server.auth.provider import TokenVerifier
from mcp.server.auth.settings import AuthSettings
from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.exceptions import ResourceNotFoundError
from mcp.server.mcpserver.resolve import Resolve
from mcp.types import CallToolResult, ImageContent, ListRootsResult, TextContent
from pydantic import BaseModel, Field

from mcp_server.paths import FileAccess, Transport, client_roots, root_paths
from ops.gpu import probe
from orchestrator import api, workflows
from orchestrator.clients.comfyui import ComfyUIClient, ComfyUIError
from orchestrator.clients.llm import LLMError, LLMRouter
from orchestrator.jobs import JobError, JobStore
from orchestrator.pipeline.params import ParamsError
from orchestrator.settings import Settings

INSTRUCTIONS = """Scriptorium: a local AI stack. Generate text with generate_text/chat, images with generate_image,
and whole illustrated articles with start_pipeline (then poll get_job). Long calls return a job_id within
about 45 seconds: call get_job(job_id) until its status is done. Articles and images of finished jobs are also
readable as resources (scriptorium://jobs/{job_id}/article.md, .../images/{name})."""


@dataclass
class State:
    settings: Settings
    llm: LLMRouter
    budget: float  # seconds a call may block before it hands back a job id (agents give up near 60 s)
    files: FileAccess  # which files tool arguments may name


Roots = Annotated[ListRootsResult | None, Resolve(client_roots)]  # the client's roots, asked for when it has them


class TextResult(BaseModel):
    text: str
    model: str | None
    tokens: int = Field(description="chunks streamed, about one token each")
    truncated: bool = Field(description="true when the time budget ran out before the model finished")


class Message(BaseModel):
    role: Literal["system", "user", "assistant"]
    content: str


class JobStarted(BaseModel):
    job_id: str
    status: str
    message: str


class JobInfo(BaseModel):
    job_id: str
    kind: str
    status: str = Field(description="queued | running | done | failed | cancelled; running without a worker = "
                                    "interrupted (start_pipeline's job can be resumed with `python -m orchestrator "
                                    "resume`)")
    stage: str | None
    progress: float
    message: str | None
    error: str | None
    result: dict | None
    resources: list[str]


class JobList(BaseModel):
    jobs: list[JobInfo]


class StackStatus(BaseModel):
    llm: list[dict] = Field(description="each upstream: url, healthy, models, error")
    comfyui: dict = Field(description="url, configured, healthy, devices (VRAM) or error")
    gpu: list[dict] | None = Field(description="per-GPU total/free bytes and the processes holding memory; null "
                                              "when there is no NVIDIA GPU")


class ModelList(BaseModel):
    models: list[dict]
    upstreams: list[dict]


def failure(message: str) -> CallToolResult:
    """A tool result the agent sees as an error it can act on; the server keeps serving."""
    return CallToolResult(content=[TextContent(type="text", text=message)], is_error=True)


def job_info(run, settings: Settings) -> JobInfo:
    resources = [f"scriptorium://jobs/{run.id}"]
    result = run.result or {}
    if result.get("article_md"):
        resources += [f"scriptorium://jobs/{run.id}/article.md", f"scriptorium://jobs/{run.id}/article.html"]
    resources += [f"scriptorium://jobs/{run.id}/images/{Path(p).name}" for p in result.get("images", [])]
    status = "interrupted" if run.interrupted else run.status
    return JobInfo(job_id=run.id, kind=run.kind, status=status, stage=run.stage, progress=run.progress,
                   message=run.message, error=run.error, result=run.result, resources=resources)


def gpu_memory() -> list[dict] | None:
    """Per-GPU memory (the probe ops uses), or None where there is no NVIDIA GPU."""
    devices, _ = probe()
    return [d.to_dict() for d in devices] or None


def build_server(settings: Settings | None = None, budget: float | None = None, transport: Transport = "stdio",
                 auth: tuple[AuthSettings, TokenVerifier] | None = None) -> MCPServer:
    """transport: how clients reach this server; it decides which files tools may read by default.
    auth: the SDK's auth settings and token verifier (HTTP with a token)."""
    settings = settings or Settings.from_env()
    budget = budget or settings.mcp_budget
    files = FileAccess.for_transport(transport, settings.mcp_allowed_dirs)

    @asynccontextmanager
    async def lifespan(_server: MCPServer):
        async with LLMRouter(settings.llm_urls, settings.llm_model, settings.llm_api_key,
                             timeout=settings.llm_timeout, max_wait=budget) as llm:
            yield State(settings, llm, budget, files)

    server = MCPServer("scriptorium", instructions=INSTRUCTIONS, lifespan=lifespan,
                       auth=auth[0] if auth else None, token_verifier=auth[1] if auth else None)

    def state_of(ctx: Context) -> State:
        return ctx.request_context.lifespan_context

    async def complete(ctx: Context, messages: list[dict], max_tokens: int, temperature: float,
                       model: str | None) -> TextResult | CallToolResult:
        state = state_of(ctx)
        deadline = time.monotonic() + state.budget
        parts: list[str] = []
        truncated = False
        try:
            stream = state.llm.stream_chat(messages, model=model, max_tokens=max_tokens, temperature=temperature)
            async for delta in stream:
                parts.append(delta)
                if len(parts) % 16 == 0:
                    await ctx.report_progress(len(parts), max_tokens, f"{len(parts)} tokens")
                if time.monotonic() > deadline:
                    truncated = True
                    await stream.aclose()
                    break
        except LLMError as e:
            return failure(f"The LLM is unavailable: {e}")
        return TextResult(text="".join(parts), model=model or state.llm.model, tokens=len(parts), truncated=truncated)

    @server.tool()
    async def generate_text(
        prompt: Annotated[str, Field(min_length=1, description="what to write")],
        ctx: Context,
        system: Annotated[str | None, Field(description="optional system instructions")] = None,
        max_tokens: Annotated[int, Field(ge=1, le=8192)] = 512,
        temperature: Annotated[float, Field(ge=0, le=2)] = 0.7,
        model: Annotated[str | None, Field(description="a model from list_models; default: the first")] = None,
    ) -> TextResult:
        """Generate text with the local LLM. Returns the text; `truncated` is true if it ran past the time budget
        (ask for fewer max_tokens then)."""
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
        return await complete(ctx, messages, max_tokens, temperature, model)

    @server.tool()
    async def chat(
        messages: Annotated[list[Message], Field(min_length=1, description="the conversation so far")],
        ctx: Context,
        max_tokens: Annotated[int, Field(ge=1, le=8192)] = 512,
        temperature: Annotated[float, Field(ge=0, le=2)] = 0.7,
        model: str | None = None,
    ) -> TextResult:
        """Continue a conversation (system/user/assistant messages) with the local LLM; returns the reply."""
        return await complete(ctx, [m.model_dump() for m in messages], max_tokens, temperature, model)

    @server.tool()
    async def generate_image(
        prompt: Annotated[str, Field(min_length=1, description="what the picture shows")],
        ctx: Context,
        negative_prompt: Annotated[str | None, Field(description="what to avoid")] = None,
        width: Annotated[int | None, Field(ge=64, le=2048, multiple_of=8)] = None,
        height: Annotated[int | None, Field(ge=64, le=2048, multiple_of=8)] = None,
        steps: Annotated[int | None, Field(ge=1, le=150)] = None,
        seed: Annotated[int | None, Field(ge=0)] = None,
        template: Annotated[str, Field(description="sd15, sdxl, flux, or a path to an API-format workflow inside "
                                                    "the allowed directories")] = "sd15",
        roots: Roots = None,
    ) -> CallToolResult:
        """Generate an image with ComfyUI. Returns the image and its saved path; if it takes longer than the time
        budget, returns a job_id instead: call get_job(job_id) until done."""
        state = state_of(ctx)
        if not state.settings.comfyui_url:
            return failure("ComfyUI is not configured: set SCRIPTORIUM_COMFYUI_URL, or start the stack's comfyui "
                           "service (`ops up` with the image profile)")
        if template not in workflows.BUILTIN:
            template = str(state.files.check(template, root_paths(roots), "template"))
        params = {"prompt": prompt, "negative_prompt": negative_prompt, "width": width, "height": height,
                  "steps": steps, "seed": seed, "template": template}
        try:
            run = await asyncio.to_thread(api.start_image, params, state.settings)
        except ParamsError as e:
            return failure(str(e))
        store = JobStore(state.settings.jobs_db)
        deadline = time.monotonic() + state.budget
        while time.monotonic() < deadline:
            run = store.get(run.id)
            if run.status in ("done", "failed", "cancelled"):
                break
            await ctx.report_progress(run.progress, 1.0, run.message or "rendering")
            await asyncio.sleep(0.25)
        info = job_info(run, state.settings)
        if run.status == "failed":
            return failure(f"Image generation failed: {run.error}")
        if run.status != "done":
            info.message = "still rendering: call get_job with this job_id until its status is done"
            return CallToolResult(content=[TextContent(type="text", text=json.dumps(info.model_dump()))],
                                  structured_content=info.model_dump())
        content = [TextContent(type="text", text=f"Saved {', '.join(run.result['images'])}")]
        for path in run.result["images"]:
            data = base64.b64encode(Path(path).read_bytes()).decode()
            content.append(ImageContent(type="image", data=data, mime_type="image/png"))
        return CallToolResult(content=content, structured_content={**info.model_dump(), "paths": run.result["images"]})

    @server.tool()
    async def start_pipeline(
        topic: Annotated[str, Field(min_length=1, description="what the article is about")],
        ctx: Context,
        audience: str = "general readers",
        sections: Annotated[int, Field(ge=1, le=12)] = 4,
        images: Annotated[int, Field(ge=0, le=12, description="illustrated sections (needs ComfyUI)")] = 2,
        words_per_section: Annotated[int, Field(ge=30, le=2000)] = 150,
        sources: Annotated[list[str], Field(description="paths of text/Markdown files to ground the research, "
                                                        "inside the allowed directories")] = [],  # noqa: B006 pydantic copies defaults
        roots: Roots = None,
    ) -> JobStarted:
        """Start writing an illustrated article (research, writing, illustration, assembly) as a background job.
        Returns a job_id at once; poll get_job(job_id) for progress and the result's file paths."""
        state = state_of(ctx)
        sources = [str(state.files.check(s, root_paths(roots), "source")) for s in sources]
        try:
            run = await asyncio.to_thread(api.start_article, {
                "topic": topic, "audience": audience, "sections": sections, "images": images,
                "words_per_section": words_per_section, "sources": sources}, state.settings)
        except ParamsError as e:
            return failure(str(e))
        return JobStarted(job_id=run.id, status=run.status, message="started; poll get_job with this job_id")

    @server.tool()
    async def get_job(job_id: Annotated[str, Field(min_length=1)], ctx: Context) -> JobInfo:
        """Status, stage, progress and (when done) result of a job: file paths, an excerpt, and resource URIs."""
        try:
            return job_info(JobStore(state_of(ctx).settings.jobs_db).get(job_id), state_of(ctx).settings)
        except JobError as e:
            return failure(str(e))

    @server.tool()
    async def cancel_job(job_id: Annotated[str, Field(min_length=1)], ctx: Context) -> JobInfo:
        """Cancel a job: it stops between steps, and a running ComfyUI render is interrupted."""
        try:
            run = api.cancel(job_id, state_of(ctx).settings)
        except JobError as e:
            return failure(str(e))
        return job_info(run, state_of(ctx).settings)

    @server.tool()
    async def list_jobs(ctx: Context, limit: Annotated[int, Field(ge=1, le=200)] = 20) -> JobList:
        """Recent jobs, newest first."""
        store = JobStore(state_of(ctx).settings.jobs_db)
        return JobList(jobs=[job_info(r, state_of(ctx).settings) for r in store.recent(limit)])

    @server.tool()
    async def list_models(ctx: Context) -> ModelList:
        """The models the LLM upstreams serve (SCRIPTORIUM_LLM_URL may list several)."""
        upstreams = await state_of(ctx).llm.upstreams()
        if not any(u["healthy"] for u in upstreams):
            return failure("No LLM upstream answers: " + "; ".join(f"{u['url']}: {u['error']}" for u in upstreams)
                           + ". Start the backend with `ops up` or check SCRIPTORIUM_LLM_URL.")
        models = [{"id": m, "upstream": u["url"]} for u in upstreams for m in u["models"]]
        return ModelList(models=models, upstreams=upstreams)

    @server.tool()
    async def stack_status(ctx: Context) -> StackStatus:
        """Health of the LLM upstreams and ComfyUI, and GPU memory when known."""
        state = state_of(ctx)
        comfy = {"url": state.settings.comfyui_url, "healthy": False, "configured": bool(state.settings.comfyui_url)}
        if state.settings.comfyui_url:
            try:
                async with ComfyUIClient(state.settings.comfyui_url) as client:
                    stats = await asyncio.wait_for(client.system_stats(), timeout=10)
                comfy.update(healthy=True, devices=stats.get("devices", []))
            except (TimeoutError, ComfyUIError) as e:
                comfy["error"] = str(e) or "timeout"
        return StackStatus(llm=await state.llm.upstreams(), comfyui=comfy, gpu=await asyncio.to_thread(gpu_memory))

    # Resources: jobs and their artifacts ---------------------------------------------------------------

    def run_of(job_id: str):
        try:
            return JobStore(settings.jobs_db).get(job_id)
        except JobError as e:
            raise ResourceNotFoundError(str(e)) from None

    @server.resource("scriptorium://jobs/{job_id}", mime_type="application/json")
    async def job_resource(job_id: str) -> str:
        return json.dumps(job_info(run_of(job_id), settings).model_dump(), indent=2)

    @server.resource("scriptorium://jobs/{job_id}/article.md", mime_type="text/markdown")
    async def article_md(job_id: str) -> str:
        run = run_of(job_id)
        if not (run.result or {}).get("article_md"):
            raise ResourceNotFoundError(f"job {job_id} has no article (yet)")
        return Path(run.result["article_md"]).read_text()

    @server.resource("scriptorium://jobs/{job_id}/article.html", mime_type="text/html")
    async def article_html(job_id: str) -> str:
        run = run_of(job_id)
        if not (run.result or {}).get("article_html"):
            raise ResourceNotFoundError(f"job {job_id} has no article (yet)")
        return Path(run.result["article_html"]).read_text()

    @server.resource("scriptorium://jobs/{job_id}/images/{name}", mime_type="image/png")
    async def image(job_id: str, name: str) -> bytes:
        run = run_of(job_id)
        for path in (run.result or {}).get("images", []):
            if Path(path).name == name:
                return Path(path).read_bytes()
        raise ResourceNotFoundError(f"job {job_id} has no image {name}")

    @server.custom_route("/health", methods=["GET"])
    async def health(_request):
        from starlette.responses import JSONResponse

        return JSONResponse({"status": "ok"})

    return server
