"""The Messages API's server-sent events for one generation.

message_start once the engine has taken the request (its prompt's cached tokens known) or after one ping
interval, then `ping` every few seconds while the prompt is processed (so a client's read
timeout does not fire on a long prompt), and after `keepalive` seconds without content an empty delta in the
open block, or in a block opened for it (thinking where the prompt opened the reasoning, else text): Claude
Code's stream watchdog counts every event but `ping`; per content block content_block_start, content_block_delta
(thinking_delta and, before it stops, signature_delta for a thinking block; text_delta; or input_json_delta for
a tool_use block's input) and content_block_stop; then message_delta
(stop_reason, usage) and message_stop. An error after the stream began is an `error` event.
"""

import json
import logging
from collections.abc import AsyncIterator

from fastapi.responses import StreamingResponse

from backend.server.errors import APIError
from backend.server.messages_shapes import message_usage, stop_reason, toolu
from backend.server.streams import Silence, piece_events, with_pings

log = logging.getLogger("backend.server")

PING_SECONDS = 5.0
KEEPALIVE_SECONDS = 60.0  # serve --stream-keepalive; Claude Code's watchdog is 300 s at the least


def sse(kind: str, **fields) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **fields}, ensure_ascii=False)}\n\n"


class _Blocks:
    """The content blocks as they are built: at most one open at a time (thinking, text, or a tool_use)."""

    def __init__(self, signature: str):
        self.count, self.signature = 0, signature
        self.open: str | None = None  # "thinking", "text" or "tool_use"
        self.calls: dict[int, int] = {}  # the parser's call index -> its block's index
        self.has_calls = False

    def text(self, delta: str, kind: str = "text") -> list[str]:
        """A piece of text, or of thinking (kind "thinking"), in the block of its kind (opened when needed)."""
        out = []
        if self.open != kind:
            out += self.close()
            block = {"type": kind, kind: ""} | ({"signature": ""} if kind == "thinking" else {})
            out.append(sse("content_block_start", index=self.count, content_block=block))
            self.open = kind
        out.append(sse("content_block_delta", index=self.count, delta={"type": f"{kind}_delta", kind: delta}))
        return out

    def call_piece(self, piece: dict) -> list[str]:
        out = []
        if "id" in piece:  # a new call
            out += self.close()
            block = {"type": "tool_use", "id": toolu(piece["id"]), "name": piece["function"]["name"], "input": {}}
            out.append(sse("content_block_start", index=self.count, content_block=block))
            self.open, self.has_calls = "tool_use", True
            self.calls[piece["index"]] = self.count
        delta = piece["function"].get("arguments", "")
        if delta and self.open == "tool_use" and self.calls.get(piece["index"]) == self.count:
            out.append(sse("content_block_delta", index=self.count,
                           delta={"type": "input_json_delta", "partial_json": delta}))
        return out

    def keepalive(self, kind: str) -> list[str]:
        """An empty delta in the open block, or in a new block of kind: content for a watchdog, no text."""
        if self.open == "tool_use":
            return [sse("content_block_delta", index=self.count, delta={"type": "input_json_delta", "partial_json": ""})]
        return self.text("", self.open or kind)

    def close(self) -> list[str]:
        if self.open is None:
            return []
        out = []
        if self.open == "thinking":
            out.append(sse("content_block_delta", index=self.count,
                           delta={"type": "signature_delta", "signature": self.signature}))
        out.append(sse("content_block_stop", index=self.count))
        self.open, self.count = None, self.count + 1
        return out


def stream_message(model: str, mid: str, gen, prompt_len: int, tools, signature: str = "",
                   context_ended: bool = False, keepalive: float = KEEPALIVE_SECONDS) -> StreamingResponse:
    """context_ended: the context, not the client's max_tokens, limits the answer's length (stop_reason);
    keepalive: seconds without content before an empty delta is sent (0: never)."""

    async def events() -> AsyncIterator[str]:
        ping_every = min(PING_SECONDS, keepalive or PING_SECONDS)
        items = with_pings(gen, ping_every).__aiter__()
        # message_start waits for the engine's first step of the request (a ping interval at most), which tells
        # how much of the prompt the prefix cache holds: clients read the cache from message_start's usage.
        try:
            first = await items.__anext__()
        except StopAsyncIteration:
            first = None
        except Exception as e:  # noqa: BLE001 reported in-band below, after message_start
            first, items = None, _raising(e)
        else:
            items = _chained(first, items)
        cached = first.num_cached_tokens if first is not None else 0
        yield sse("message_start", message={
            "id": mid, "type": "message", "role": "assistant", "model": model, "content": [], "stop_reason": None,
            "stop_sequence": None, "usage": message_usage(prompt_len, 0, cached)})
        blocks = _Blocks(signature)
        reader = tools.new_reader()
        tokens, finished = 0, None
        quiet, empty = Silence(ping_every), Silence(keepalive)  # since any event; since one with content
        try:
            async for delta in items:
                out = []
                for d in delta.outputs if delta is not None else ():
                    tokens += len(d.token_ids)
                    if d.finished:
                        finished = d
                    out += piece_events(reader.read(d.text, d.finished), blocks.text, blocks.call_piece, "thinking")
                if delta is not None:
                    cached = delta.num_cached_tokens
                content = bool(out)
                if not content and quiet.due():
                    out.append(sse("ping"))
                if not content and empty.due():
                    out += blocks.keepalive("thinking" if tools.in_thinking else "text")
                    content = True
                if out:
                    quiet.broken()
                if content:
                    empty.broken()
                for e in out:
                    yield e
        except APIError as e:
            yield sse("error", error=e.anthropic_body()["error"])
            return
        except Exception as e:  # noqa: BLE001 the stream has started: report in-band, not as a 500
            log.exception("message stream failed")
            yield sse("error", error={"type": "api_error", "message": f"internal error: {e}"})
            return
        for e in blocks.close():
            yield e
        reason, sequence = stop_reason(finished.finish_reason if finished else None,
                                       finished.stop_reason if finished else None, blocks.has_calls,
                                       context_ended)
        yield sse("message_delta", delta={"stop_reason": reason, "stop_sequence": sequence},
                  usage=message_usage(prompt_len, tokens, cached))
        yield sse("message_stop")

    return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


async def _chained(first, rest: AsyncIterator) -> AsyncIterator:
    yield first
    async for item in rest:
        yield item


async def _raising(error: BaseException) -> AsyncIterator:
    raise error
    yield  # an async generator
