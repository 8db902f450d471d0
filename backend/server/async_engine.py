"""One engine loop for every HTTP request: a thread that steps the engine, fed from asyncio.

The engine is not thread-safe, so everything that touches it (adding, aborting, sleeping)
is a command the loop thread runs between steps; outputs travel back to each request's
asyncio queue on the event loop.
"""

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace

import torch

from backend.engine.admission import AdmittedEmbedding, AdmittedRequest
from backend.engine.deltas import RequestDelta
from backend.engine.llm_engine import LLMEngine
from backend.server.metrics import ModelMetrics
from backend.server.protocol import APIError

log = logging.getLogger(__name__)


@dataclass
class RequestTiming:
    arrival: float
    num_prompt_tokens: int = 0
    first_token: float | None = None
    last_token: float | None = None
    num_tokens: int = 0
    first_finish_reason: str | None = None  # of choice 0: the request's outcome in the metrics


# One step of a healthy engine takes well under a second to a few seconds (a full budget of prompt tokens
# through a large model on the CPU: a minute or two), and the longest call, a wake-up that reads the weights
# from disk again, about as long; one that has not returned after this long is stuck (a hung kernel, a
# deadlock) and /health says so (--engine-stuck-after).
ENGINE_STUCK_AFTER = 300.0


class AsyncEngine:
    def __init__(self, engine: LLMEngine, metrics: ModelMetrics | None = None,
                 stuck_after: float = ENGINE_STUCK_AFTER):
        self.engine = engine
        self.metrics = metrics
        self.stuck_after = stuck_after
        self.died: str | None = None  # why the loop thread stopped, if it did
        self._busy: tuple[str, float] | None = None  # what the loop thread is running (a step, a call), since when
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue, RequestTiming]] = {}
        self._wake = threading.Event()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    def problem(self) -> str | None:
        """Why this engine cannot serve (its loop thread died, or one step has hung), or None when it can."""
        if self.died is not None or (not self._thread.is_alive() and not self._stopping):
            return f"the engine loop stopped: {self.died or 'unknown reason'}; restart the server"
        busy = self._busy
        if busy is not None and time.monotonic() - busy[1] > self.stuck_after:
            return (f"the engine is stuck in {busy[0]}: it has not returned for {time.monotonic() - busy[1]:.0f} s "
                    f"(--engine-stuck-after {self.stuck_after:g}); restart the server")
        return None

    @contextmanager
    def _running(self, what: str) -> Iterator[None]:
        self._busy = (what, time.monotonic())
        try:
            yield
        finally:
            self._busy = None

    def _outcome(self, outcome: str) -> None:
        if self.metrics:
            self.metrics.record_outcome(outcome)

    # Called from the event loop ------------------------------------------------------------------------

    def generate(self, request_id: str, request: AdmittedRequest, group: str | None = None,
                 client: str | None = None) -> AsyncIterator[RequestDelta]:
        """Yields what each step that advanced the request (LLMEngine.validate_request's result) changed, the last
        delta finished. group: the client's request it is part of (one of a completion's prompts), admitted in
        turns as one; client: who sent it (client_id.py), whose turns and slot share it takes."""
        if client is not None:
            request = replace(request, client=client)
        return self._follow(request_id, len(request.token_ids),
                            lambda e: e.add_request(request_id, request, group=group))

    async def embed(self, request_id: str, inputs: AdmittedEmbedding) -> list[torch.Tensor]:
        """Each input's embedding, computed step by step beside the other requests (aborted when the caller
        is cancelled: its client went away)."""
        deltas = [d async for d in self._follow(request_id, sum(len(i) for i in inputs.inputs),
                                                lambda e: e.add_embedding_request(request_id, inputs))]
        return deltas[-1].embeddings

    async def _follow(self, request_id: str, num_prompt_tokens: int, add: Callable[[LLMEngine], None]
                      ) -> AsyncIterator[RequestDelta]:
        """add(engine) on the loop thread, then the request's deltas until the finished one."""
        if self._stopping:
            raise APIError(503, "the server is shutting down", type="service_unavailable")
        if self.died is not None:
            raise APIError(503, self.problem(), type="service_unavailable")
        loop = asyncio.get_running_loop()
        outputs: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = (loop, outputs, RequestTiming(time.monotonic(), num_prompt_tokens))
        self._submit(("add", request_id, add))
        finished = False
        try:
            while True:
                item = await outputs.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:  # the client went away, or an error: stop spending compute on it
                self._submit(("abort", request_id))

    async def call(self, fn: Callable[[LLMEngine], object], name: str | None = None) -> object:
        """Run fn(engine) on the loop thread between steps and return its result; name: what /health calls it
        should it hang (default: the function's name)."""
        if self.died is not None:
            raise APIError(503, self.problem(), type="service_unavailable")
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        self._submit(("call", fn, loop, done, name or fn.__name__))
        return await done

    async def drain(self, timeout: float, why: str = "the model was put to sleep") -> None:
        """Wait up to timeout seconds for the requests in flight to finish, then end the rest with a 503 saying
        why (a stream gets it as its last event)."""
        deadline = time.monotonic() + timeout
        while self._streams and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self._streams:
            await self.call(lambda e: self._abort_all(e, why), "abort_all")

    def _abort_all(self, engine: LLMEngine, why: str) -> None:
        error = APIError(503, f"the request was aborted: {why}", type="service_unavailable")
        for request_id in list(self._streams):
            engine.abort_request(request_id)
            self._end(request_id, error, "abort")

    def stop(self) -> None:
        self._stopping = True
        self._submit(("stop",))
        self._thread.join(timeout=30)

    def _submit(self, command: tuple) -> None:
        self._commands.put(command)
        self._wake.set()

    # The loop thread ----------------------------------------------------------------------------------

    def _deliver(self, request_id: str, item) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            loop, outputs, _ = stream
            loop.call_soon_threadsafe(outputs.put_nowait, item)

    def _end(self, request_id: str, error: APIError, outcome: str) -> None:
        """Fail one request: its error to its stream, which closes, and its outcome to the metrics."""
        self._deliver(request_id, error)
        self._streams.pop(request_id, None)
        self._outcome(outcome)

    def _run_command(self, command: tuple) -> bool:
        kind = command[0]
        if kind == "add":
            _, request_id, add = command
            if request_id not in self._streams:
                return True  # aborted before it started
            try:
                with self._running(f"adding request {request_id}"):
                    add(self.engine)
            except ValueError as e:  # bad input found late: a client error, reported to its request
                self._end(request_id, APIError(400, str(e), param=getattr(e, "param", None)), "rejected")
            except Exception as e:  # reported to the request that caused it
                log.exception("adding request %s failed", request_id)
                error = APIError(500, f"internal error: {type(e).__name__}: {e}", type="internal_error")
                self._end(request_id, error, "error")
        elif kind == "abort":
            _, request_id = command
            self.engine.abort_request(request_id)
            if self._streams.pop(request_id, None) is not None:
                self._outcome("abort")
        elif kind == "call":
            _, fn, loop, done, name = command
            try:
                with self._running(f"a call ({name})"):
                    result = fn(self.engine)
            except Exception as e:
                loop.call_soon_threadsafe(settle, done, None, e)
            else:
                loop.call_soon_threadsafe(settle, done, result, None)
        elif kind == "stop":
            return False
        return True

    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as e:  # noqa: BLE001 a bug in the loop itself: say so on /health, fail what waits
            log.exception("the engine loop stopped")
            self.died = f"{type(e).__name__}: {e}"
            error = APIError(503, f"the engine loop stopped: {self.died}", type="service_unavailable")
            for request_id in list(self._streams):
                self._deliver(request_id, error)
            self._streams.clear()
            while not self._commands.empty():  # this thread is the queue's only reader
                command = self._commands.get_nowait()
                if command[0] == "call":
                    command[2].call_soon_threadsafe(settle, command[3], None, error)

    def _loop(self) -> None:
        while True:
            while not self._commands.empty():  # this thread is the queue's only reader
                if not self._run_command(self._commands.get_nowait()):
                    return
            if not self.engine.has_unfinished_requests():
                self._wake.wait()
                self._wake.clear()
                continue
            try:
                with self._running("one step"):
                    outputs = self.engine.step_deltas()
            except Exception as e:  # a bug in the engine: fail the requests of the batch, keep serving
                log.exception("an engine step failed")
                error = APIError(500, f"internal error: {type(e).__name__}: {e}", type="internal_error")
                for request_id in list(self._streams):
                    self.engine.abort_request(request_id)
                    self._end(request_id, error, "error")
                continue
            now = time.monotonic()
            for out in outputs:
                stream = self._streams.get(out.request_id)
                if stream is None:
                    continue
                if out.error is not None:  # processing this request failed; the others go on
                    error = APIError(400, out.error, param=out.error_param) if out.error_param is not None else \
                        APIError(500, f"generating this request failed: {out.error}", type="internal_error")
                    self._end(out.request_id, error, "error")
                    continue
                timing = stream[2]
                self._record_timing(timing, out, now)
                self._deliver(out.request_id, out)
                if out.finished:
                    self._streams.pop(out.request_id, None)
                    if self.metrics:
                        self.metrics.record_finished(timing.first_finish_reason, timing.num_prompt_tokens,
                                                     timing.num_tokens)

    def _record_timing(self, timing: RequestTiming, delta: RequestDelta, now: float) -> None:
        produced = 0
        for d in delta.outputs:
            produced += len(d.token_ids)
            if d.index == 0 and d.finish_reason is not None:
                timing.first_finish_reason = d.finish_reason
        if not produced:
            return
        ttft = gap = None
        if timing.first_token is None:
            timing.first_token = now
            ttft = now - timing.arrival
        else:
            gap = now - timing.last_token
        timing.last_token = now
        timing.num_tokens += produced
        if self.metrics:
            self.metrics.record_token_timing(ttft, gap)


def settle(future: asyncio.Future, result, error) -> None:
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
