"""Shared-run tools: a run is a workspace several agents each do a stage of. create_run and get_run, and the
stages research, write_section, write_sections, illustrate and assemble (each a job, returned within the call
budget or followed with get_job); the edits are in run_edit_tools.py. Every change is recorded with the calling
client's name and the tool."""

import asyncio
from typing import Annotated, Literal

from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from pydantic import Field

from mcp_server.image_tools import follow
from mcp_server.job_tools import stage_result
from mcp_server.lazy import lazy
from mcp_server.run_models import RunCreated, RunState, StageOutcome
from mcp_server.tool_context import CREATES, READ_ONLY, Roots, Sampling, checked_file, client_name, state_of

api = lazy("orchestrator.api")  # the pipelines load on the first tool call

RunId = Annotated[str, Field(min_length=1, description="a run id from create_run")]
Index = Annotated[int, Field(ge=0, le=11, description="the section's index in the outline (0 for the first)")]


def actor(ctx: Context, tool: str) -> "api.Actor":
    """Who is calling, with which tool."""
    return api.Actor(client_name(ctx), tool)


async def call_api(function, *args, **kwargs):
    try:
        return await asyncio.to_thread(function, *args, **kwargs)
    except (api.JobError, api.ParamsError, api.EditError, api.TemplateError) as e:
        raise ToolError(str(e)) from None


def outcome(job) -> StageOutcome:
    result = stage_result(job.result) if job.result else None
    message = job.message
    if job.interrupted:
        message = (
            "its worker stopped before the stage finished: call the same tool again to finish what is missing"
        )
    elif job.queue_position:
        message = (f"queued for a worker (number {job.queue_position}): call get_job with this job_id until its "
                   "status is done, then get_run")
    elif job.status in ("queued", "running"):
        message = "still working: call get_job with this job_id until its status is done, then get_run"
    status = "interrupted" if job.interrupted else job.status
    return StageOutcome(
        job_id=job.id,
        run_id=job.params["run_id"],
        stage=job.params["stage"],
        status=status,
        progress=job.progress,
        message=message,
        error=job.error,
        result=result,
    )


async def stage(ctx: Context, run_id: str, name: str, args: dict) -> StageOutcome:
    """Start the stage as a job and follow it for the call's budget."""
    state = state_of(ctx)
    job = await call_api(api.start_stage, run_id, name, args, actor(ctx, name), state.settings)
    job = await follow(ctx, job)
    if job.status == "failed":
        raise ToolError(f"{name} failed: {job.error}")
    if job.status == "cancelled":
        raise ToolError(f"{name} (job {job.id}) was cancelled")
    return outcome(job)


def register(server: MCPServer) -> None:
    @server.tool(title="Create a shared run", annotations=CREATES)
    async def create_run(
        topic: Annotated[str, Field(min_length=1, description="what the article is about")],
        ctx: Context,
        audience: str = "general readers",
        length: Annotated[
            Literal["short", "medium", "long"], Field(description="3, 5 or 8 sections")
        ] = "short",
        style: Annotated[
            str | None, Field(description="how it is written, e.g. 'plain and practical'")
        ] = None,
        sources: Annotated[
            list[str],
            Field(
                description="paths of text/Markdown files to ground the research, "
                "inside the allowed directories"
            ),
        ] = [],  # noqa: B006
        sections: Annotated[int | None, Field(ge=1, le=12, description="instead of length's")] = None,
        images: Annotated[
            int | None, Field(ge=0, le=12, description="illustrated sections (default 2)")
        ] = None,
        words_per_section: Annotated[int | None, Field(ge=30, le=2000)] = None,
        sampling: Sampling = None,
        roots: Roots = None,
    ) -> RunCreated:
        """Create an article run that agents share: each does a stage (research, writing, illustration,
        assembly) with the tools of that stage, reading the others' work with get_run."""
        params = {
            "topic": topic,
            "audience": audience,
            "length": length,
            "style": style,
            "sources": [checked_file(ctx, roots, s, "source") for s in sources],
            "sections": sections,
            "images": images,
            "words_per_section": words_per_section,
            "sampling": sampling,
        }
        run = await call_api(
            api.create_run, {k: v for k, v in params.items() if v is not None}, state_of(ctx).settings
        )
        return RunCreated(
            run_id=run.id,
            sections=run.params["sections"],
            images=run.params["images"],
            message="created; call research (or set_outline) next",
        )

    @server.tool(title="Get a shared run", annotations=READ_ONLY)
    async def get_run(run_id: RunId, ctx: Context) -> RunState:
        """The run's outline, each section's text and each image with status, version and whether it is stale,
        the assembled outputs, and the history of who changed what."""
        return RunState(**await call_api(api.get_run, run_id, state_of(ctx).settings))

    @server.tool(title="Research a run's outline", annotations=CREATES)
    async def research(
        run_id: RunId,
        ctx: Context,
        instructions: Annotated[
            str | None, Field(description="what the outline should cover or avoid")
        ] = None,
        redo: Annotated[bool, Field(description="make a new outline even if one stands")] = False,
    ) -> StageOutcome:
        """Make the outline (title, sections with key points) with the local LLM from the run's topic and sources.
        An outline that stands is kept unless instructions differ from its own or redo is true."""
        return await stage(ctx, run_id, "research", {"instructions": instructions, "redo": redo})

    @server.tool(title="Write one section", annotations=CREATES)
    async def write_section(
        run_id: RunId,
        index: Index,
        ctx: Context,
        instructions: Annotated[
            str | None, Field(description="what to change, e.g. 'more concrete examples'")
        ] = None,
        redo: bool = False,
    ) -> StageOutcome:
        """Write (or rewrite) one section with the local LLM. It is written when missing or stale, when your
        instructions differ from those it was written with, or with redo; otherwise it stands."""
        return await stage(
            ctx, run_id, "write_section", {"index": index, "instructions": instructions, "redo": redo}
        )

    @server.tool(title="Write the missing sections", annotations=CREATES)
    async def write_sections(run_id: RunId, ctx: Context) -> StageOutcome:
        """Write every section not yet written, concurrently; sections that stand (or are stale) are kept."""
        return await stage(ctx, run_id, "write_sections", {})

    @server.tool(title="Illustrate a run", annotations=CREATES)
    async def illustrate(
        run_id: RunId,
        ctx: Context,
        index: Annotated[
            int | None, Field(ge=0, le=11, description="one section's image; none: all missing")
        ] = None,
        prompt: Annotated[
            str | None, Field(description="the image prompt (default: the LLM writes one)")
        ] = None,
        template: Annotated[str | None, Field(description="sd15, sdxl, flux (default: the run's)")] = None,
        checkpoint: Annotated[str | None, Field(description="a checkpoint from list_image_models")] = None,
    ) -> StageOutcome:
        """Render the images with ComfyUI (the LLM lends it the GPU when it must): one, or all not yet made."""
        if template is not None and template not in ("sd15", "sdxl", "flux"):
            raise ToolError(
                "template must be sd15, sdxl or flux here (run_workflow takes your own workflow file)"
            )
        return await stage(
            ctx,
            run_id,
            "illustrate",
            {"index": index, "prompt": prompt, "template": template, "checkpoint": checkpoint},
        )

    @server.tool(title="Assemble a run's article", annotations=CREATES)
    async def assemble(
        run_id: RunId,
        ctx: Context,
        formats: Annotated[list[Literal["md", "html"]], Field(min_length=1)] = ["md", "html"],  # noqa: B006
        post_process: Annotated[bool, Field(description="web-sized JPEGs and a thumbnail (ffmpeg)")] = True,
    ) -> StageOutcome:
        """Assemble article.md and article.html from the parts as they stand (edits included); every section
        must be written. Calling it again after an edit uses the edited parts."""
        return await stage(ctx, run_id, "assemble", {"formats": list(formats), "post_process": post_process})
