"""Server-sent events, and requests' outputs gathered from their streams of deltas."""

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from backend.engine.deltas import OutputAssembler, RequestDelta
from backend.outputs import RequestOutput
from backend.server.errors import APIError

log = logging.getLogger("backend.server")


def event(body: dict) -> str:
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"


def sse(events: AsyncIterator[str]) -> StreamingResponse:
    async def body():
        try:
            async for item in events:
                yield item
        except APIError as e:
            yield event(e.body())
        except Exception as e:  # noqa: BLE001 the stream has started: report in-band, not as a 500
            log.exception("stream failed")
            yield event(APIError(500, f"internal error: {e}", type="internal_error").body())
        yield "data: [DONE]\n\n"

    return StreamingResponse(body(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


def answer(result: dict | StreamingResponse, headers: dict[str, str]) -> dict | JSONResponse | StreamingResponse:
    """A route's answer (a whole body or a stream) with headers added where there are any."""
    if isinstance(result, StreamingResponse):
        result.headers.update(headers)
        return result
    return JSONResponse(result, headers=headers) if headers else result


async def merge(gens: list) -> AsyncIterator[tuple[int, RequestDelta]]:
    """Interleave several requests' output streams, tagged with their position."""
    if len(gens) == 1:
        async for out in gens[0]:
            yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i, gen):
        try:
            async for out in gen:
                await queue.put((i, out))
        except BaseException as e:  # noqa: BLE001 handed to the consumer
            await queue.put((i, e))
        finally:
            await queue.put((i, done))

    tasks = [asyncio.create_task(pump(i, g)) for i, g in enumerate(gens)]
    remaining = len(gens)
    try:
        while remaining:
            i, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()


async def collect(gens: list, prompts: list[list[int]], n: int) -> list[RequestOutput]:
    """Each request's whole output, assembled from its deltas."""
    assemblers = [OutputAssembler("", None, prompt, n) for prompt in prompts]
    async for i, delta in merge(gens):
        assemblers[i].add(delta)
    return [a.output() for a in assemblers]


async def until_disconnect(request: Request, coro):
    """Await coro, cancelling it (which aborts its requests) if the client goes away meanwhile."""
    task = asyncio.ensure_future(coro)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=0.5)
            if done:
                return task.result()
            if await request.is_disconnected():
                task.cancel()
                raise APIError(499, "client disconnected", type="client_closed_request")
    finally:
        if not task.done():
            task.cancel()


async def with_pings(gen, interval: float) -> AsyncIterator:
    """gen's items, and None whenever interval seconds pass without one."""
    it = gen.__aiter__()
    while True:
        step = asyncio.ensure_future(it.__anext__())
        try:
            while True:
                done, _ = await asyncio.wait({step}, timeout=interval)
                if done:
                    break
                yield None
            try:
                item = step.result()
            except StopAsyncIteration:
                return
        finally:
            if not step.done():
                step.cancel()
        yield item


def piece_events(pieces: list, text: Callable[..., list[str]], call: Callable[[dict], list[str]],
                 reasoning_kind: str) -> list[str]:
    """The events a choice reader's pieces (ChoiceReader.read) make in an API's blocks or items: text(s) for the
    answer, text(s, reasoning_kind) for the reasoning, call(piece) for each tool-call piece."""
    out = []
    for piece in pieces:
        out += text(piece.reasoning, reasoning_kind) if piece.reasoning else []
        out += text(piece.content) if piece.content else []
        for one in piece.tool_calls:
            out += call(one)
    return out


@dataclass
class Silence:
    """How long a stream has sent nothing (of some kind), against the most it may: every seconds (0: no limit).
    The engine gives a request's stream a delta at each step, with no text while its prompt is processed, so
    a stream checks this at each item, not only when with_pings finds none."""

    every: float
    since: float = field(default_factory=time.monotonic)

    def due(self) -> bool:
        return bool(self.every) and time.monotonic() - self.since >= self.every

    def broken(self) -> None:
        self.since = time.monotonic()
