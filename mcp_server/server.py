"""The MCP server: text, images, pipeline jobs, models and stack status for agents, assembled from the tool,
resource, prompt and logging modules of this package."""

from collections.abc import Callable
from contextlib import asynccontextmanager

import anyio
from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from mcp.server.subscriptions import InMemorySubscriptionBus
from mcp.types import Tool as MCPTool

from common.settings import Settings
from mcp_server import (
    image_tools,
    initialize_result,
    job_tools,
    logs,
    mcp_prompts,
    resources,
    role_prompts,
    run_edit_tools,
    run_tools,
    text_tools,
    toolsets,
)
from mcp_server.allowed_paths import FileAccess, Transport
from mcp_server.tool_context import State
from orchestrator.clients.router import LLMRouter


def _untitled(schema):
    """A JSON schema without pydantic's generated titles ("Max Tokens" for max_tokens): they repeat the names."""
    if isinstance(schema, list):
        return [_untitled(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    named = ("properties", "$defs")  # their keys are names, which may be "title"
    return {k: ({n: _untitled(s) for n, s in v.items()} if k in named else _untitled(v))
            for k, v in schema.items() if not (k == "title" and isinstance(v, str))}


class Server(MCPServer):
    """The SDK's server, telling a client that calls a tool of a toolset it does not list which toolset has it.
    Tools are listed as compactly as they stay clear, since the agent's context holds them on every turn:
    descriptions without their docstrings' indentation, input schemas without generated titles."""

    toolsets: tuple[str, ...] = ("all",)

    async def list_tools(self) -> list[MCPTool]:
        tools = await super().list_tools()
        for tool in tools:
            tool.description = " ".join((tool.description or "").split())
            tool.input_schema = _untitled(tool.input_schema)
        return tools

    def tool(self, name: str | None = None, **kwargs) -> Callable:
        """The SDK's decorator, registering only the tools of the chosen toolsets: building a tool's schemas
        takes time at every start."""
        register = super().tool(name, **kwargs)

        def decorator(fn):
            return register(fn) if (name or fn.__name__) in toolsets.chosen(self.toolsets) else fn

        return decorator

    async def call_tool(self, name: str, arguments: dict, context=None):
        if name in toolsets.ALL and name not in toolsets.chosen(self.toolsets):
            raise ToolError(toolsets.not_listed(name, self.toolsets))
        return await super().call_tool(name, arguments, context)


def build_server(settings: Settings | None = None, budget: float | None = None,
                 transport: Transport = "stdio") -> MCPServer:
    """transport: how clients reach this server; it decides which files tools may read by default.
    The tools listed are those of
    settings.mcp_toolsets (toolsets.ToolsetError names the valid ones when a name is unknown)."""
    settings = settings or Settings.from_env()
    listed = toolsets.chosen(settings.mcp_toolsets)
    team = "create_run" in listed
    budget = budget or settings.mcp_budget
    files = FileAccess.for_transport(transport, settings.mcp_allowed_dirs)
    bus = InMemorySubscriptionBus()

    @asynccontextmanager
    async def lifespan(_server: MCPServer):
        # Interactive calls: a refused connection is reported at once, only a sleeping upstream is waited for.
        async with LLMRouter(settings.llm_urls, settings.llm_model, settings.llm_api_key,
                             timeout=settings.llm_timeout, max_wait=budget, connect_wait=0,
                             backoff=settings.llm_backoff, home=settings.home) as llm, \
                anyio.create_task_group() as tasks:
            watch = resources.JobWatch(settings, bus)
            tasks.start_soon(watch.run)
            yield State(settings, llm, budget, files, watch)
            tasks.cancel_scope.cancel()

    server = Server(initialize_result.NAME, title=initialize_result.TITLE,
                    instructions=initialize_result.instructions(settings.mcp_toolsets),
                    website_url=initialize_result.website(), version=initialize_result.server_version(),
                    lifespan=lifespan, subscriptions=bus)
    server.toolsets = settings.mcp_toolsets
    text_tools.register(server)
    image_tools.register(server)
    job_tools.register(server)
    run_tools.register(server)
    run_edit_tools.register(server)
    resources.register(server, settings, lambda ctx: ctx.lifespan_context.watch)
    mcp_prompts.register(server)
    if team:  # the role prompts walk an agent through the team tools
        role_prompts.register(server)
    logs.register(server)

    @server.custom_route("/health", methods=["GET"])
    async def health(_request):
        from starlette.responses import JSONResponse

        return JSONResponse({"status": "ok"})

    return server
