"""The MCP server: text, images, pipeline jobs, models and stack status for agents, assembled from the tool,
resource, prompt and logging modules of this package."""

from contextlib import asynccontextmanager
from importlib.metadata import PackageNotFoundError, metadata, version

import anyio
from mcp.server.auth.provider import TokenVerifier
from mcp.server.auth.settings import AuthSettings
from mcp.server.mcpserver import MCPServer
from mcp.server.subscriptions import InMemorySubscriptionBus

from mcp_server import image_tools, job_tools, logs, prompts, resources, text_tools
from mcp_server.context import State
from mcp_server.paths import FileAccess, Transport
from orchestrator.clients.llm import LLMRouter
from orchestrator.settings import Settings

INSTRUCTIONS = """Scriptorium: a local AI stack. Generate text with generate_text/chat, images with generate_image
(or run_workflow for your own ComfyUI workflow file), and whole illustrated articles with start_pipeline (then
poll get_job). Long calls return a job_id within about 45 seconds: call get_job(job_id) until its status is done.
Images come back as resource links with small thumbnails; articles and images of finished jobs are resources
(scriptorium://jobs/{job_id}/article.md, .../images/{name}). File arguments must lie in your roots or the
directories in SCRIPTORIUM_MCP_ALLOWED_DIRS."""


def _version() -> str:
    try:
        return version("scriptorium")
    except PackageNotFoundError:
        return "0.0.0+source"


def _website() -> str | None:
    """The project's home page from its package metadata ([project.urls] Homepage), if it names one."""
    try:
        meta = metadata("scriptorium")
    except PackageNotFoundError:
        return None
    for entry in meta.get_all("Project-URL") or []:
        label, _, url = entry.partition(",")
        if label.strip().lower() in ("homepage", "home", "documentation", "source"):
            return url.strip()
    return meta.get("Home-page") or None


def build_server(settings: Settings | None = None, budget: float | None = None, transport: Transport = "stdio",
                 auth: tuple[AuthSettings, TokenVerifier] | None = None) -> MCPServer:
    """transport: how clients reach this server; it decides which files tools may read by default.
    auth: the SDK's auth settings and token verifier (HTTP with a token)."""
    settings = settings or Settings.from_env()
    budget = budget or settings.mcp_budget
    files = FileAccess.for_transport(transport, settings.mcp_allowed_dirs)
    bus = InMemorySubscriptionBus()

    @asynccontextmanager
    async def lifespan(_server: MCPServer):
        # Interactive calls: a refused connection is reported at once, only a sleeping upstream is waited for.
        async with LLMRouter(settings.llm_urls, settings.llm_model, settings.llm_api_key,
                             timeout=settings.llm_timeout, max_wait=budget, connect_wait=0) as llm, \
                anyio.create_task_group() as tasks:
            watch = resources.JobWatch(settings, bus)
            tasks.start_soon(watch.run)
            yield State(settings, llm, budget, files, watch)
            tasks.cancel_scope.cancel()

    server = MCPServer("scriptorium", title="Scriptorium", instructions=INSTRUCTIONS, website_url=_website(),
                       version=_version(), lifespan=lifespan, subscriptions=bus,
                       auth=auth[0] if auth else None, token_verifier=auth[1] if auth else None)
    text_tools.register(server)
    image_tools.register(server)
    job_tools.register(server)
    resources.register(server, settings, lambda ctx: ctx.lifespan_context.watch)
    prompts.register(server)
    logs.register(server)

    @server.custom_route("/health", methods=["GET"])
    async def health(_request):
        from starlette.responses import JSONResponse

        return JSONResponse({"status": "ok"})

    return server
