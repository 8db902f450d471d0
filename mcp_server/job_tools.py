"""Job tools: start_pipeline, get_job, cancel_job, list_jobs, and stack_status; jobs through orchestrator.api."""

import asyncio
from typing import Annotated

from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from pydantic import Field

from mcp_server.job_resources import job_status, job_uris
from mcp_server.lazy import lazy
from mcp_server.models import (
    ArticleJobResult,
    ComfyStatus,
    GPUDevice,
    ImageJobResult,
    JobInfo,
    JobList,
    JobStarted,
    StackStatus,
    StageJobResult,
    Upstream,
)
from mcp_server.tool_context import (
    CREATES,
    DESTRUCTIVE,
    READ_ONLY,
    Roots,
    Sampling,
    checked_file,
    client_name,
    state_of,
)
from orchestrator.clients.comfyui import ComfyUIClient, ComfyUIError

api = lazy("orchestrator.api")  # the pipelines load on the first tool call

FINAL = ("done", "failed", "cancelled")


def stage_result(result: dict) -> StageJobResult:
    article = result.get("article")
    return StageJobResult(**{**result, "article": ArticleJobResult(**article) if article else None})


def job_info(run) -> JobInfo:
    typed = None
    if run.result and run.kind == "stage":
        typed = stage_result(run.result)
    elif run.result:
        typed = ArticleJobResult(**run.result) if run.kind == "article" else ImageJobResult(**run.result)
    return JobInfo(job_id=run.id, kind=run.kind, status=job_status(run), stage=run.stage, progress=run.progress,
                   message=run.message, error=run.error, queue_position=run.queue_position, result=typed,
                   resources=job_uris(run))


async def cancel_and_settle(job_id: str, ctx: Context, timeout: float = 5.0):
    """Ask the job's worker to stop (it aborts its LLM requests and interrupts its ComfyUI prompt by id) and wait
    a little for it to say so."""
    settings = state_of(ctx).settings
    await asyncio.to_thread(api.cancel, job_id, settings)
    return await asyncio.to_thread(api.wait_settled, job_id, settings, timeout)


def _run(job_id: str, ctx: Context):
    try:
        return api.get(job_id, state_of(ctx).settings)
    except api.UnknownRun:
        raise ToolError(f"no job {job_id!r}: list_jobs shows the jobs there are, newest first") from None
    except api.JobError as e:
        raise ToolError(str(e)) from None


def gpu_memory() -> list[GPUDevice] | None:
    """Per-GPU memory (the probe ops uses), or None where there is no NVIDIA GPU."""
    from common.gpu import probe

    devices, _ = probe()
    return [GPUDevice(**d.to_dict()) for d in devices] or None


def register(server: MCPServer) -> None:
    @server.tool(title="Start an article pipeline", annotations=CREATES)
    async def start_pipeline(
        topic: Annotated[str, Field(min_length=1, description="what the article is about")],
        ctx: Context,
        audience: str = "general readers",
        sections: Annotated[int, Field(ge=1, le=12)] = 4,
        images: Annotated[int, Field(ge=0, le=12, description="illustrated sections (needs ComfyUI)")] = 2,
        words_per_section: Annotated[int, Field(ge=30, le=2000)] = 150,
        sources: Annotated[list[str], Field(description="text/Markdown files to ground the research")] = [],  # noqa: B006 pydantic copies defaults
        sampling: Sampling = None,
        roots: Roots = None,
    ) -> JobStarted:
        """Write an illustrated article (research, writing, illustration, assembly) as a background job. Returns
        a job_id at once: poll get_job(job_id) for progress and the files. When every worker is busy the job
        waits, queued, with its place in the queue."""
        state = state_of(ctx)
        sources = [checked_file(ctx, roots, s, "source") for s in sources]
        try:
            run = await asyncio.to_thread(api.start_article, {
                "topic": topic, "audience": audience, "sections": sections, "images": images,
                "words_per_section": words_per_section, "sources": sources,
                "sampling": sampling or {}}, state.settings, client_name(ctx))
        except (api.ParamsError, api.JobError) as e:
            raise ToolError(str(e)) from None
        said = f"queued: number {run.queue_position} for a worker" if run.queue_position else "started"
        return JobStarted(job_id=run.id, status=run.status, queue_position=run.queue_position,
                          message=f"{said}; poll get_job with this job_id")

    @server.tool(title="Get a job", annotations=READ_ONLY)
    async def get_job(job_id: Annotated[str, Field(min_length=1)], ctx: Context) -> JobInfo:
        """Status, stage, progress and (when done) result of a job: file paths, an excerpt, and resource URIs."""
        return job_info(_run(job_id, ctx))

    @server.tool(title="Cancel a job", annotations=DESTRUCTIVE)
    async def cancel_job(job_id: Annotated[str, Field(min_length=1)], ctx: Context) -> JobInfo:
        """Cancel a job by its full id: aborts its LLM requests and its ComfyUI prompt; a queued one never
        starts. A finished job stays as it is."""
        run = _run(job_id, ctx)
        if run.status in FINAL:
            return job_info(run)
        return job_info(await cancel_and_settle(run.id, ctx))

    @server.tool(title="List jobs", annotations=READ_ONLY)
    async def list_jobs(
        ctx: Context,
        limit: Annotated[int, Field(ge=1, le=200)] = 20,
        cursor: Annotated[str | None, Field(description="next_cursor of the previous page")] = None,
    ) -> JobList:
        """Jobs, newest first, a page at a time: pass next_cursor back as cursor for older ones."""
        try:
            runs, next_cursor = await asyncio.to_thread(api.page, limit, cursor, state_of(ctx).settings)
        except api.JobError as e:
            raise ToolError(str(e)) from None
        return JobList(jobs=[job_info(r) for r in runs], next_cursor=next_cursor)

    @server.tool(title="Stack status", annotations=READ_ONLY)
    async def stack_status(ctx: Context) -> StackStatus:
        """Health of the LLM upstreams and ComfyUI, and GPU memory when known."""
        state = state_of(ctx)
        url = state.settings.comfyui_url
        comfy = ComfyStatus(url=url, configured=bool(url), healthy=False)
        if url:
            try:
                async with ComfyUIClient(url) as client:
                    stats = await asyncio.wait_for(client.system_stats(), timeout=10)
                comfy.healthy, comfy.devices = True, stats.get("devices", [])
            except (TimeoutError, ComfyUIError) as e:
                comfy.error = str(e) or "timeout"
        upstreams = [Upstream(**u) for u in await state.llm.upstreams()]
        return StackStatus(llm=upstreams, comfyui=comfy, gpu=await asyncio.to_thread(gpu_memory))
