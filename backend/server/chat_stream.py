"""The chat completions API's server-sent chunks for one request: the role first, then per choice its reasoning,
content and tool-call pieces, its finish_reason, and with include_usage a last chunk of usage alone. After
`keepalive` seconds without a chunk (a long prompt being processed, or a request waiting its turn), a chunk with
an empty content delta, as OpenAI's streams open with: the chat clients' stream watchdogs (opencode, Hermes
Agent, Cursor) count chunks, and this one adds nothing to the answer."""

from collections.abc import AsyncIterator

from backend.server.prompt_logprobs_shapes import prompt_logprobs_json
from backend.server.protocol import ChatRequest, chat_logprobs, now, usage
from backend.server.streams import Silence, event, with_pings


def stream_chunks(
    model: str, rid: str, req: ChatRequest, gen, prompt: list[int], tools, keepalive: float = 0
) -> AsyncIterator[str]:
    """tools: the request's ChatTools (backend/server/chat.py); keepalive: seconds without a chunk before an
    empty one is sent (0: never)."""
    created, include_usage = now(), bool(req.stream_options and req.stream_options.include_usage)
    pending: list = []  # the prompt's logprobs (asked for), carried by the next chunk once they are computed

    def chunk(choices: list[dict], usage_value=None) -> str:
        body = {
            "id": rid,
            "object": "chat.completion.chunk",
            "created": created,
            "model": model,
            "choices": choices,
        }
        if include_usage:
            body["usage"] = usage_value
        if pending:
            body["prompt_logprobs"] = prompt_logprobs_json(pending.pop(), prompt, req.prompt_logprobs)
        return event(body)

    def piece(index: int, delta: dict, logprobs=None, reason=None) -> str:
        return chunk([{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": reason}])

    async def events():
        readers = [tools.new_reader() for _ in range(req.n)]
        for i in range(req.n):
            yield piece(i, {"role": "assistant", "content": ""})
        # The engine gives a delta at every step of a prompt's processing, with no text: the silence counts
        # from the last chunk sent, not from the last delta.
        quiet = Silence(keepalive)
        completion_tokens = cached = 0
        ids: list[list[int]] = [[] for _ in range(req.n)]
        async for delta in with_pings(gen, keepalive) if keepalive else gen:
            out = []
            if delta is not None and delta.prompt_logprobs is not None and req.prompt_logprobs is not None:
                pending.append(delta.prompt_logprobs)
            for d in delta.outputs if delta is not None else ():
                completion_tokens += len(d.token_ids)
                ids[d.index] += d.token_ids
                lp = None
                if req.logprobs and d.logprobs and d.token_ids:
                    lp = chat_logprobs(d.logprobs, d.token_ids, req.top_logprobs or 0)
                reader = readers[d.index]
                out += [
                    piece(d.index, part, part_lp)
                    for part, part_lp in _parts(reader.read(d.text, d.finished), lp)
                ]
                if d.finished:
                    out.append(piece(d.index, {}, reason=finish_reason(d.finish_reason, reader.has_calls)))
            if delta is not None:
                cached = delta.num_cached_tokens
            if not out and quiet.due():
                out.append(piece(0, {"content": ""}))
            if out:
                quiet.broken()
            for e in out:
                yield e
        if include_usage:
            yield chunk(
                [], usage(len(prompt), completion_tokens, cached, sum(map(tools.reasoning_tokens, ids)))
            )

    return events()


def finish_reason(reason: str | None, calls: bool) -> str | None:
    """A choice's finish_reason: a stop after tool calls is OpenAI's "tool_calls"."""
    return "tool_calls" if calls and reason == "stop" else reason


def _parts(deltas: list, logprobs) -> list[tuple[dict, dict | None]]:
    """A reader's deltas as chunk deltas: reasoning, content, then each tool-call piece (logprobs on the first)."""
    parts: list[tuple[dict, dict | None]] = []
    for delta in deltas:
        if delta.reasoning:
            parts.append(({"reasoning_content": delta.reasoning, "reasoning": delta.reasoning}, None))
        if delta.content:
            parts.append(({"content": delta.content}, None))
        for call in delta.tool_calls:
            parts.append(({"tool_calls": [call]}, None))
    if logprobs is not None:
        if parts:
            parts[0] = (parts[0][0], logprobs)
        else:
            parts.append(({}, logprobs))
    return parts
