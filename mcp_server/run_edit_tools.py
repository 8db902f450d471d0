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
EDITS = CREATES  # an edit keeps the version it replaces: nothing is destroyed
JOB_PREFIX = "scriptorium://jobs/"


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
        version = await call_api(
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
        version = await call_api(
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
        version = await call_api(
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
        version = await call_api(
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
