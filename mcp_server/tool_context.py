"""What every tool module shares: the server's state, the client's roots, annotation presets, errors."""

from dataclasses import dataclass
from typing import Annotated

from mcp.server.mcpserver import Context
from mcp.server.mcpserver.exceptions import ToolError
from mcp.server.mcpserver.resolve import Resolve
from mcp.types import ListRootsResult, ToolAnnotations
from pydantic import Field

from common.settings import Settings
from mcp_server.allowed_paths import FileAccess, client_roots, root_paths
from orchestrator.clients.router import LLMRouter


@dataclass
class State:
    settings: Settings
    llm: LLMRouter
    budget: float  # seconds a call may block before it hands back a job id (agents give up near 60 s)
    files: FileAccess  # which files tool arguments may name
    watch: object = None  # resources.JobWatch: subscriptions to jobs


Roots = Annotated[ListRootsResult | None, Resolve(client_roots)]  # the client's roots, asked for when it has them
# Per-stage sampling overrides of an article run (orchestrator.pipeline.sampling), e.g.
# {"sections": {"repetition_penalty": 1.3}}; the run records them, merged with the defaults, in its params.
Sampling = Annotated[dict | None, Field(description='per-stage sampling overrides: {"outline"|"sections"|'
                     '"image_prompts": {temperature, top_p, min_p, repetition_penalty, frequency_penalty, '
                     'presence_penalty, stop}, "loop_threshold": 0.1}; unset: measured defaults')]

# Hermes' `trust: untrusted` and other clients ask before tools that change things; these say which do.
READ_ONLY = ToolAnnotations(read_only_hint=True, destructive_hint=False, idempotent_hint=True, open_world_hint=False)
CREATES = ToolAnnotations(read_only_hint=False, destructive_hint=False, idempotent_hint=False, open_world_hint=False)
DESTRUCTIVE = ToolAnnotations(read_only_hint=False, destructive_hint=True, idempotent_hint=True,
                              open_world_hint=False)


def state_of(ctx: Context) -> State:
    return ctx.request_context.lifespan_context


def client_name(ctx: Context) -> str:
    """Who is calling: the name the client gave in its clientInfo (what a job's history and queue cap count by)."""
    params = ctx.session.client_params
    info = getattr(params, "client_info", None) if params is not None else None
    return getattr(info, "name", None) or "unnamed client"


def checked_file(ctx: Context, roots: ListRootsResult | None, value: str, what: str = "file") -> str:
    """The resolved path of a file argument, refused (as the tool's error) outside the allowed directories."""
    return str(state_of(ctx).files.check(value, root_paths(roots), what))


def comfyui_url(ctx: Context) -> str:
    url = state_of(ctx).settings.comfyui_url
    if not url:
        raise ToolError("ComfyUI is not configured: set SCRIPTORIUM_COMFYUI_URL, or start the stack's comfyui service "
                        "(`ops up` with the image profile)")
    return url
