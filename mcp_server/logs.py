"""The `logging` capability: job progress as notifications/message, at the level each client set.

On handshake-era connections (2025-06-18, 2025-11-25) the SDK sends every level, so the level a
client chose with logging/setLevel is kept here, per connection, and honoured before sending.
"""

import contextlib
import warnings
import weakref

from mcp.server.mcpserver import Context, MCPServer
from mcp.types import EmptyResult, LoggingLevel, SetLevelRequestParams

LEVELS: tuple[LoggingLevel, ...] = ("debug", "info", "notice", "warning", "error", "critical", "alert", "emergency")
DEFAULT: LoggingLevel = "info"
LOGGER = "scriptorium"
_chosen: "weakref.WeakKeyDictionary[object, LoggingLevel]" = weakref.WeakKeyDictionary()


def _connection(ctx_session) -> object:
    return getattr(ctx_session, "_connection", ctx_session)  # the session object is per request, this is not


async def log(ctx: Context, level: LoggingLevel, message: str) -> None:
    """Send a log message to the client if it asked for this level (info by default)."""
    chosen = _chosen.get(_connection(ctx.session), DEFAULT)
    if LEVELS.index(level) < LEVELS.index(chosen):
        return
    with warnings.catch_warnings():  # logging is deprecated from 2026-07-28; today's clients speak 2025 revisions
        warnings.simplefilter("ignore")
        with contextlib.suppress(Exception):  # a client that went away must not fail the tool
            await ctx.log(level, message, logger_name=LOGGER)


def register(server: MCPServer) -> None:
    """Serve logging/setLevel, which also advertises the logging capability. MCPServer has no public hook for
    it, so the handler goes onto its low-level server."""

    async def set_level(ctx, params: SetLevelRequestParams) -> EmptyResult:
        _chosen[_connection(ctx.session)] = params.level
        return EmptyResult()

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        server._lowlevel_server.add_request_handler("logging/setLevel", SetLevelRequestParams, set_level)
