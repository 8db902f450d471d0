"""Shared-run tools: a run is a workspace several agents each do a stage of. create_run and get_run; the stages
research, write_section, write_sections, illustrate and assemble (each a job, returned within the call budget or
followed with get_job); and the edits set_outline, set_section and set_image, refused on a stale expected_version.
Every change is recorded with the calling client's name and the tool."""

import asyncio
from pathlib import Path
from typing import Annotated, Any, Literal

from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from pydantic import Field

from mcp_server.context import CREATES, READ_ONLY, Roots, Sampling, checked_file, client_name, state_of
from mcp_server.image_tools import follow
from mcp_server.job_tools import stage_result
from mcp_server.lazy import lazy
from mcp_server.run_models import PartSet, RunCreated, RunState, StageOutcome

api = lazy("orchestrator.api")  # the pipelines load on the first tool call

RunId = Annotated[str, Field(min_length=1, description="a run id from create_run")]
Index = Annotated[int, Field(ge=0, le=11, description="the section's index in the outline (0 for the first)")]
Version = Annotated[
    int, Field(ge=0, description="the part's version in get_run when you read it (0: not made)")
]
EDITS = CREATES  # an edit keeps the version it replaces: nothing is destroyed
JOB_PREFIX = "scriptorium://jobs/"


def actor(ctx: Context, tool: str) -> "api.Actor":
    """Who is calling, with which tool."""
    return api.Actor(client_name(ctx), tool)


async def _call(function, *args, **kwargs):
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
    job = await _call(api.start_stage, run_id, name, args, actor(ctx, name), state.settings)
    job = await follow(ctx, job)
    if job.status == "failed":
        raise ToolError(f"{name} failed: {job.error}")
    if job.status == "cancelled":
        raise ToolError(f"{name} (job {job.id}) was cancelled")
    return outcome(job)


def image_source(ctx: Context, roots, value: str) -> Path:
    """A file an agent names for set_image: a finished job's image resource, or a path the path rules allow."""
    if value.startswith(JOB_PREFIX):
        job_id, _, name = value[len(JOB_PREFIX) :].partition("/images/")
        try:
            job = api.get(job_id, state_of(ctx).settings)
        except api.JobError as e:
            raise ToolError(str(e)) from None
        for path in (job.result or {}).get("images", []):
            if Path(path).name == name:
                return Path(path)
        raise ToolError(f"{value} is not an image of job {job_id}")
    return Path(checked_file(ctx, roots, value, "image"))


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
        run = await _call(
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
        return RunState(**await _call(api.get_run, run_id, state_of(ctx).settings))

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

    @server.tool(title="Set a run's outline", annotations=EDITS)
    async def set_outline(
        run_id: RunId,
        outline: Annotated[
            dict[str, Any],
            Field(
                description='{"title": "...", "sections": [{"heading": "...", '
                '"key_points": ["...", "..."]}]}: 1 to 12 sections, '
                "2 or 3 key points each"
            ),
        ],
        expected_version: Version,
        ctx: Context,
    ) -> PartSet:
        """Edit or replace the outline; refused if it changed since you read expected_version (read it again)."""
        version = await _call(
            api.set_outline,
            run_id,
            outline,
            expected_version,
            actor(ctx, "set_outline"),
            state_of(ctx).settings,
        )
        return PartSet(
            run_id=run_id,
            part="research",
            version=version,
            message=f"outline version {version}; sections made from older versions are now stale",
        )

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

    @server.tool(title="Set a section's text", annotations=EDITS)
    async def set_section(
        run_id: RunId,
        index: Index,
        text: Annotated[
            str, Field(min_length=1, description="the section's Markdown paragraphs, no heading")
        ],
        expected_version: Version,
        ctx: Context,
    ) -> PartSet:
        """Replace a section's text with your own; refused if it changed since you read expected_version."""
        version = await _call(
            api.set_section,
            run_id,
            index,
            text,
            expected_version,
            actor(ctx, "set_section"),
            state_of(ctx).settings,
        )
        return PartSet(
            run_id=run_id,
            part=f"write:{index:02d}",
            version=version,
            message=f"section {index} version {version}; assemble again to use it",
        )

    @server.tool(title="Reject a section", annotations=EDITS)
    async def reject_section(
        run_id: RunId,
        index: Index,
        reason: Annotated[
            str, Field(min_length=1, description="what is wrong: the writer rewrites it from this")
        ],
        ctx: Context,
        expected_version: Annotated[int | None, Field(ge=0, description="the version you reviewed")] = None,
    ) -> PartSet:
        """Send a section back to the writer: get_run shows it as rejected with your reason until it is
        rewritten (write_section or write_sections rewrite it from the reason)."""
        version = await _call(
            api.reject_section,
            run_id,
            index,
            reason,
            actor(ctx, "reject_section"),
            expected_version,
            state_of(ctx).settings,
        )
        return PartSet(
            run_id=run_id,
            part=f"write:{index:02d}",
            version=version,
            message=f"section {index} version {version} rejected",
        )

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

    @server.tool(title="Set a section's image", annotations=EDITS)
    async def set_image(
        run_id: RunId,
        index: Index,
        image: Annotated[
            str,
            Field(
                description="a path inside the allowed directories, or an image resource "
                "(scriptorium://jobs/<job_id>/images/<name>) from generate_image"
            ),
        ],
        ctx: Context,
        prompt: Annotated[str | None, Field(description="its caption (what it shows)")] = None,
        expected_version: Annotated[
            int | None, Field(ge=0, description="refuse if the image changed since")
        ] = None,
        roots: Roots = None,
    ) -> PartSet:
        """Use an image made elsewhere as a section's illustration (stored as PNG; the one it replaces is kept)."""
        source = image_source(ctx, roots, image)
        version = await _call(
            api.set_image,
            run_id,
            index,
            source,
            actor(ctx, "set_image"),
            prompt,
            expected_version,
            state_of(ctx).settings,
        )
        return PartSet(
            run_id=run_id,
            part=f"illustrate:{index:02d}",
            version=version,
            message=f"image {index} version {version}; assemble again to use it",
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
