"""The Responses API's typed server-sent events for one generation.

response.created, response.in_progress; per output item: response.output_item.added, then for a message
response.content_part.added, response.output_text.delta..., response.output_text.done,
response.content_part.done, for the reasoning the same with response.reasoning_text.delta and .done, or for a function call response.function_call_arguments.delta...,
response.function_call_arguments.done, or for a custom tool call (once its input is whole)
response.custom_tool_call_input.delta and .done; response.output_item.done; then response.completed (or
response.incomplete when max_output_tokens cut it short). An error after the stream began is an `error`
event. Each event carries its sequence_number. After `keepalive` seconds without an event (a long prompt),
response.in_progress again: Codex's stream watchdog counts events, and this one changes nothing in the answer.
"""

import json
import logging
from collections.abc import AsyncIterator

from fastapi.responses import StreamingResponse

from backend.server.errors import APIError
from backend.server.responses_shapes import (
    message_item,
    new_item_id,
    reasoning_item,
    response_body,
    response_usage,
)
from backend.server.responses_tools import ToolNames
from backend.server.streams import Silence, piece_events, with_pings

# per text item type: how it is made, its id's prefix, and its part's type (which names its events)
TEXT_ITEMS = {"message": (message_item, "msg", "output_text"), "reasoning": (reasoning_item, "rs", "reasoning_text")}


def _part(kind: str, text: str) -> dict:
    if kind == "output_text":
        return {"type": kind, "text": text, "annotations": [], "logprobs": []}
    return {"type": kind, "text": text}

log = logging.getLogger("backend.server")


class _Events:
    def __init__(self):
        self.sequence = 0

    def __call__(self, kind: str, **fields) -> str:
        body = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(body, ensure_ascii=False)}\n\n"


class _Output:
    """The output items as they are built: at most one open at a time (a message, or a function call)."""

    def __init__(self, emit: _Events, names: ToolNames):
        self.emit, self.message_item, self.new_id, self.names = emit, message_item, new_item_id, names
        self.items: list[dict] = []
        self.open: dict | None = None
        self.calls: dict[int, dict] = {}  # the parser's call index -> its item

    def text(self, delta: str, item_type: str = "message") -> list[str]:
        """A piece of the answer, or of the reasoning (item_type "reasoning"), in the item of its type."""
        make, prefix, part = TEXT_ITEMS[item_type]
        extra = {"logprobs": []} if part == "output_text" else {}
        out = []
        if self.open is None or self.open["type"] != item_type:
            out += self.close()
            self.open = make(self.new_id(prefix), "", "in_progress")
            self.open["content"] = []
            out.append(self.emit("response.output_item.added", output_index=len(self.items), item=self.open))
            out.append(self.emit("response.content_part.added", item_id=self.open["id"], output_index=len(self.items),
                                 content_index=0, part=_part(part, "")))
            self.open["_text"] = ""
        self.open["_text"] += delta
        out.append(self.emit(f"response.{part}.delta", item_id=self.open["id"], output_index=len(self.items),
                             content_index=0, delta=delta, **extra))
        return out

    def call_piece(self, piece: dict) -> list[str]:
        out = []
        if "id" in piece:  # a new call
            out += self.close()
            name = piece["function"]["name"]
            if self.names.is_custom(name):  # its input is known once its arguments are whole: sent at close
                self.open = {"type": "_custom", "call_id": piece["id"], "name": name, "arguments": ""}
            else:
                self.open = self.names.item(piece["id"], self.new_id("fc"), name, "", "in_progress")
                out.append(self.emit("response.output_item.added", output_index=len(self.items), item=dict(self.open)))
            self.calls[piece["index"]] = self.open
        item = self.calls.get(piece["index"])
        delta = piece["function"].get("arguments", "")
        if item is self.open and delta:
            item["arguments"] += delta
            if item["type"] == "function_call":
                out.append(self.emit("response.function_call_arguments.delta", item_id=item["id"],
                                     output_index=len(self.items), delta=delta))
        return out

    def close(self, status: str = "completed") -> list[str]:
        item, self.open = self.open, None
        if item is None:
            return []
        index, out = len(self.items), []
        if item["type"] in TEXT_ITEMS:
            text, kind = item.pop("_text"), TEXT_ITEMS[item["type"]][2]
            part = _part(kind, text)
            extra = {"logprobs": []} if kind == "output_text" else {}
            out.append(self.emit(f"response.{kind}.done", item_id=item["id"], output_index=index,
                                 content_index=0, text=text, **extra))
            out.append(self.emit("response.content_part.done", item_id=item["id"], output_index=index,
                                 content_index=0, part=part))
            item["content"] = [part]
        elif item["type"] == "function_call":
            out.append(self.emit("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                                 name=item["name"], arguments=item["arguments"]))
        else:
            item = self.names.item(item["call_id"], self.new_id("ctc"), item["name"], item["arguments"], "in_progress")
            # added with no input yet, as OpenAI sends it: a client that appends the deltas to it has it once
            out.append(self.emit("response.output_item.added", output_index=index, item={**item, "input": ""}))
            out.append(self.emit("response.custom_tool_call_input.delta", item_id=item["id"], output_index=index,
                                 delta=item["input"]))
            out.append(self.emit("response.custom_tool_call_input.done", item_id=item["id"], output_index=index,
                                 input=item["input"]))
        item["status"] = status
        self.items.append(item)
        out.append(self.emit("response.output_item.done", output_index=index, item=item))
        return out


def stream_response(model: str, req, rid: str, created: float, gen, prompt_len: int, tools, names: ToolNames,
                    keepalive: float = 0) -> StreamingResponse:
    """keepalive: seconds without an event before response.in_progress is sent again (0: never)."""
    emit = _Events()

    async def events() -> AsyncIterator[str]:
        yield emit("response.created", response=response_body(req, rid, model, created, "in_progress", [], None))
        yield emit("response.in_progress", response=response_body(req, rid, model, created, "in_progress", [], None))
        output = _Output(emit, names)
        reader = tools.new_reader()
        tokens, reason, cached, ids, quiet = 0, None, 0, [], Silence(keepalive)
        try:
            async for delta in with_pings(gen, keepalive) if keepalive else gen:
                out = []
                for d in delta.outputs if delta is not None else ():
                    tokens += len(d.token_ids)
                    ids += d.token_ids
                    if d.finished:
                        reason = d.finish_reason
                    out += piece_events(reader.read(d.text, d.finished), output.text, output.call_piece, "reasoning")
                if delta is not None:
                    cached = delta.num_cached_tokens
                if not out and quiet.due():
                    out.append(emit("response.in_progress", response=response_body(
                        req, rid, model, created, "in_progress", list(output.items), None)))
                if out:
                    quiet.broken()
                for e in out:
                    yield e
        except APIError as e:
            yield emit("error", code=e.code or e.type, message=e.message, param=e.param)
            return
        except Exception as e:  # noqa: BLE001 the stream has started: report in-band, not as a 500
            log.exception("response stream failed")
            yield emit("error", code="internal_error", message=f"internal error: {e}", param=None)
            return
        status = "incomplete" if reason == "length" else "completed"
        for e in output.close(status):
            yield e
        body = response_body(req, rid, model, created, status, output.items,
                             response_usage(prompt_len, tokens, cached, tools.reasoning_tokens(ids)))
        yield emit("response.incomplete" if status == "incomplete" else "response.completed", response=body)

    return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
