"""Shared-run edits: set_outline, set_section, reject_section and set_image, each refused on a stale
expected_version and recorded with the calling client's name and the tool; an edit keeps the version it replaces."""

from pathlib import Path
from typing import Annotated, Any

from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from pydantic import Field

from mcp_server.run_models import PartSet
from mcp_server.run_tools import Index, RunId, actor, api, call_api
from mcp_server.tool_context import CREATES, Roots, checked_file, state_of

Version = Annotated[
    int, Field(ge=0, description="the part's version in get_run when you read it (0: not made)")
]
SectionText = Annotated[str, Field(min_length=1, description="the section's Markdown paragraphs, no heading")]
Reason = Annotated[str, Field(min_length=1, description="what is wrong: the writer rewrites it from this")]
EDITS = CREATES  # an edit keeps the version it replaces: nothing is destroyed
JOB_PREFIX = "scriptorium://jobs/"
AGAIN = "; assemble again to use it"


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


async def edit(ctx: Context, function, part: str, what: str, then: str, args: dict) -> PartSet:
    """One edit through the run API's function of the tool's name, recorded as the calling client's, and what it
    made: `what` version N, then `then`."""
    version = await call_api(
        function, actor=actor(ctx, function.__name__), settings=state_of(ctx).settings, **args
    )
    return PartSet(
        run_id=args["run_id"], part=part, version=version, message=f"{what} version {version}{then}"
    )


def register(server: MCPServer) -> None:
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
        args = dict(run_id=run_id, outline=outline, expected_version=expected_version)
        return await edit(
            ctx,
            api.set_outline,
            "research",
            "outline",
            "; sections made from older versions are now stale",
            args,
        )

    @server.tool(title="Set a section's text", annotations=EDITS)
    async def set_section(
        run_id: RunId,
        index: Index,
        text: SectionText,
        expected_version: Version,
        ctx: Context,
    ) -> PartSet:
        """Replace a section's text with your own; refused if it changed since you read expected_version."""
        args = dict(run_id=run_id, index=index, text=text, expected_version=expected_version)
        return await edit(ctx, api.set_section, f"write:{index:02d}", f"section {index}", AGAIN, args)

    @server.tool(title="Reject a section", annotations=EDITS)
    async def reject_section(
        run_id: RunId,
        index: Index,
        reason: Reason,
        ctx: Context,
        expected_version: Annotated[int | None, Field(ge=0, description="the version you reviewed")] = None,
    ) -> PartSet:
        """Send a section back to the writer: get_run shows it as rejected with your reason until it is
        rewritten (write_section or write_sections rewrite it from the reason)."""
        args = dict(run_id=run_id, index=index, reason=reason, expected_version=expected_version)
        return await edit(
            ctx, api.reject_section, f"write:{index:02d}", f"section {index}", " rejected", args
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
        args = dict(run_id=run_id, index=index, path=source, prompt=prompt, expected_version=expected_version)
        return await edit(ctx, api.set_image, f"illustrate:{index:02d}", f"image {index}", AGAIN, args)
