"""Resources: each job and its files (scriptorium://jobs/{id}, .../article.md, .../article.html,
.../images/{name}); resources/list shows the recent jobs, and a subscribed job's changes are announced with
notifications/resources/updated (2025 revisions) or on subscriptions/listen streams (2026)."""

import asyncio
import contextlib
import warnings
from pathlib import Path

from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ResourceNotFoundError
from mcp.server.subscriptions import ResourceUpdated, SubscriptionBus
from mcp.types import (
    EmptyResult,
    ListResourcesResult,
    PaginatedRequestParams,
    SubscribeRequestParams,
    UnsubscribeRequestParams,
)

from common.settings import Settings
from mcp_server.job_resources import LISTED, PREFIX, job_uri, resources_list
from mcp_server.job_tools import job_info
from mcp_server.lazy import lazy

api = lazy("orchestrator.api")  # the pipelines load on the first tool call


class JobWatch:
    """Looks at the jobs clients subscribed to (and the recent ones, for listen streams) once a second."""

    def __init__(self, settings: Settings, bus: SubscriptionBus, interval: float = 1.0):
        self.settings = settings
        self.bus = bus
        self.interval = interval
        self.subscribers: dict[str, set] = {}  # job id -> sessions (2025 resources/subscribe)
        self.seen: dict[str, float] = {}  # job id -> `updated` when last announced

    def subscribe(self, uri: str, session) -> None:
        self.subscribers.setdefault(_job_id(uri), set()).add(session)

    def unsubscribe(self, uri: str, session) -> None:
        self.subscribers.get(_job_id(uri), set()).discard(session)

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            with contextlib.suppress(Exception):  # a broken database must not end the server
                await self.tick()

    async def tick(self) -> None:
        runs, _ = await asyncio.to_thread(api.page, LISTED, None, self.settings)
        by_id = {r.id: r for r in runs}
        for job_id in [j for j in self.subscribers if j not in by_id]:
            with contextlib.suppress(api.JobError):
                by_id[job_id] = await asyncio.to_thread(api.get, job_id, self.settings)
        for run in by_id.values():
            if self.seen.setdefault(run.id, run.updated) == run.updated:
                continue
            self.seen[run.id] = run.updated
            uri = job_uri(run.id)
            await self.bus.publish(ResourceUpdated(uri=uri))
            for session in list(self.subscribers.get(run.id, ())):
                try:
                    await session.send_resource_updated(uri)
                except Exception:  # noqa: BLE001 the client went away
                    self.subscribers[run.id].discard(session)


def _job_id(uri: str) -> str:
    if not uri.startswith(PREFIX):
        raise ResourceNotFoundError(f"{uri} is not a Scriptorium job (scriptorium://jobs/{{job_id}})")
    return uri[len(PREFIX):].split("/", 1)[0]


def register(server: MCPServer, settings: Settings, watch_of) -> None:
    """watch_of(ctx) -> the JobWatch of the running server."""

    def run_of(job_id: str):
        try:
            return api.get(job_id, settings)
        except api.JobError as e:
            raise ResourceNotFoundError(str(e)) from None

    def result_file(job_id: str, key: str) -> str:
        run = run_of(job_id)
        if not (run.result or {}).get(key):
            raise ResourceNotFoundError(f"job {job_id} has no article (yet)")
        return Path(run.result[key]).read_text(encoding="utf-8")

    @server.resource("scriptorium://jobs/{job_id}", mime_type="application/json", title="A job")
    async def job_resource(job_id: str) -> str:
        return job_info(run_of(job_id)).model_dump_json(indent=2)

    @server.resource("scriptorium://jobs/{job_id}/article.md", mime_type="text/markdown", title="An article")
    async def article_md(job_id: str) -> str:
        return result_file(job_id, "article_md")

    @server.resource("scriptorium://jobs/{job_id}/article.html", mime_type="text/html", title="An article page")
    async def article_html(job_id: str) -> str:
        return result_file(job_id, "article_html")

    @server.resource("scriptorium://jobs/{job_id}/images/{name}", mime_type="image/png", title="An image")
    async def image(job_id: str, name: str) -> bytes:
        run = run_of(job_id)
        for path in (run.result or {}).get("images", []):
            if Path(path).name == name:
                return Path(path).read_bytes()
        raise ResourceNotFoundError(f"job {job_id} has no image {name}")

    # MCPServer lists only static resources and has no hooks for these methods: its low-level server does.
    async def list_resources(_ctx, _params: PaginatedRequestParams | None) -> ListResourcesResult:
        return ListResourcesResult.model_validate(await asyncio.to_thread(resources_list, settings))

    async def subscribe(ctx, params: SubscribeRequestParams) -> EmptyResult:
        run_of(_job_id(str(params.uri)))
        watch_of(ctx).subscribe(str(params.uri), ctx.session)
        return EmptyResult()

    async def unsubscribe(ctx, params: UnsubscribeRequestParams) -> EmptyResult:
        watch_of(ctx).unsubscribe(str(params.uri), ctx.session)
        return EmptyResult()

    low = server._lowlevel_server
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        low.add_request_handler("resources/list", PaginatedRequestParams, list_resources)
        low.add_request_handler("resources/subscribe", SubscribeRequestParams, subscribe)
        low.add_request_handler("resources/unsubscribe", UnsubscribeRequestParams, unsubscribe)

