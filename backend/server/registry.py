"""Several models behind one server: each loads on first use, and the least recently used idle one is
unloaded when the next does not fit the budget (a count of loaded models, and bytes of weights and KV
cache together). All engines live in this one process; an unloaded model's memory is freed outright."""

import asyncio
import fnmatch
import gc
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from backend.engine.cache_groups import group_sizes
from backend.engine.llm_engine import LLMEngine
from backend.quant.weight_sizes import module_bytes
from backend.server.async_engine import ENGINE_STUCK_AFTER, AsyncEngine, settle
from backend.server.errors import APIError
from backend.server.memory_need import disk_bytes
from backend.server.metrics import ServerMetrics
from backend.server.state import RETRY_AFTER, ServerState

log = logging.getLogger("backend.server")

LOAD_TIMEOUT = 60.0


@dataclass
class Budget:
    max_loaded: int | None = None  # models loaded at once
    memory: int | None = None  # bytes all loaded models may hold together
    load_timeout: float = LOAD_TIMEOUT  # how long a request waits for its model to load before a 503
    engine_stuck_after: float = (
        ENGINE_STUCK_AFTER  # an engine step or call running longer: /health says stuck
    )


def engine_bytes(engine: LLMEngine) -> int:
    """What a loaded engine holds: its weights (and a draft's: weight_sizes.module_bytes, with the expert slots and
    the latent attention's kv_b halves for the CPU) and its KV cache, each group's blocks as the KV budget sized them
    (sliding-window layers only their own pool's)."""
    models = [m for m in [engine.model, getattr(engine.proposer, "model", None)] if m is not None]
    tables = sum(
        t.numel() * t.element_size()
        for m in models
        for name, t in m.named_buffers()
        if name.endswith("cos_sin")
    )
    # the rotary tables too, which module_bytes leaves out
    weights = sum(module_bytes(m) for m in models) + tables
    full, window, _ = group_sizes(engine.config, engine.shape, [m.config for m in models])
    sliding = engine.runner.sliding
    return weights + engine.num_kv_blocks * full + (sliding.num_blocks * window if sliding is not None else 0)


def in_daemon_thread(fn: Callable[[], object]) -> asyncio.Future:
    """fn() on a thread of its own that does not hold up the process's exit (a load can take minutes)."""
    loop = asyncio.get_running_loop()
    done = loop.create_future()

    def run() -> None:
        result = error = None
        try:
            result = fn()
        except BaseException as e:  # noqa: BLE001 handed to the awaiting coroutine
            error = e
        loop.call_soon_threadsafe(settle, done, result, error)

    threading.Thread(target=run, name="model-load", daemon=True).start()
    return done


class ModelRegistry:
    def __init__(
        self,
        states: list[ServerState],
        budget: Budget,
        metrics: ServerMetrics,
        on_default_error: Callable[[str], None] | None = None,
        aliases: Sequence[tuple[str, str]] = (),
    ):
        self.states = (
            states  # the first is the default: loaded at start-up, and used when a request names none
        )
        self.aliases = list(aliases)  # (pattern, served name): for names that name no model
        self.budget = budget
        self.metrics = metrics
        self.on_default_error = on_default_error
        self.sleep_level = 0  # the whole server's: /sleep puts every loaded model to sleep
        self.ever_loaded = False
        self._lock: asyncio.Lock | None = None

    @property
    def default(self) -> ServerState:
        return self.states[0]

    def loaded(self) -> list[ServerState]:
        return [s for s in self.states if s.engine is not None]

    def find(self, name: str | None) -> ServerState:
        if name is None:
            return self.default
        for state in self.states:
            if state.answers_to(name):
                return state
        for pattern, target in self.aliases:
            if fnmatch.fnmatchcase(name, pattern):
                return self.find(target)
        served = ", ".join(f"`{s.served_model_name}`" for s in self.states)
        raise APIError(
            404,
            f"The model `{name}` does not exist; this server serves {served} (--model-alias maps "
            "other names onto them).",
            param="model",
            code="model_not_found",
        )

    async def acquire(self, name: str | None) -> ServerState:
        """The named model, loaded (waiting up to the load timeout for that), held until release()."""
        state = self.find(name)
        if state.engine is None or state.unloading:
            await self._wait_handed(state, time.monotonic() + self.budget.load_timeout)
        else:
            state.users += 1
        state.last_used = time.monotonic()
        return state

    def release(self, state: ServerState) -> None:
        state.users -= 1
        state.last_used = time.monotonic()

    def start(self) -> None:
        """Begin loading the default model (from the event loop, at start-up)."""
        self._begin_load(self.default)

    # Loading and unloading ------------------------------------------------------------------------------

    def _begin_load(self, state: ServerState) -> asyncio.Future:
        if state.loading is None:
            state.loading = asyncio.ensure_future(self._load(state))
        return state.loading

    async def _wait_handed(self, state: ServerState, deadline: float) -> None:
        """Wait until a load of `state` has counted this request among its users. Handed over by the load
        itself, so that a load of another model queued behind it cannot unload it before the requests that
        waited for it have run (two models taking turns would otherwise swap back and forth unserved)."""
        state.waiting += 1
        handed, failures = state.handovers, state.load_failures
        try:
            while state.handovers == handed:
                if state.load_failures != failures:  # the load this request waited for failed
                    raise APIError(
                        503,
                        f"the model `{state.served_model_name}` could not be loaded: "
                        f"{state.load_error}; the next request for it tries again",
                        type="service_unavailable",
                    )
                await self._wait_loaded(state, deadline)
        except BaseException:
            if state.handovers == handed:
                state.waiting -= 1
            else:  # handed over as the wait gave up
                self.release(state)
            raise

    def _hand_over(self, state: ServerState) -> None:
        state.users += state.waiting
        state.waiting = 0
        state.handovers += 1

    async def _wait_loaded(self, state: ServerState, deadline: float) -> None:
        if self.sleep_level:
            raise APIError(
                503,
                "the server is asleep while its memory is lent to another service; retry shortly",
                type="service_unavailable",
                headers=RETRY_AFTER,
            )
        task = self._begin_load(state)
        try:
            await asyncio.wait_for(asyncio.shield(task), max(deadline - time.monotonic(), 0))
        except TimeoutError:
            raise APIError(
                503,
                f"the model `{state.served_model_name}` is loading; retry shortly",
                type="service_unavailable",
                headers=RETRY_AFTER,
            ) from None

    async def _load(self, state: ServerState) -> None:
        if self._lock is None:
            self._lock = asyncio.Lock()
        try:
            async with self._lock:  # one load at a time, so two cannot both count on the same free room
                if state.engine is not None and not state.unloading:
                    self._hand_over(state)
                    return
                await self._make_room(state)
                state.engine = await in_daemon_thread(
                    lambda: AsyncEngine(
                        LLMEngine(state.config),
                        self.metrics.for_model(state.served_model_name),
                        self.budget.engine_stuck_after,
                    )
                )
                state.need = await in_daemon_thread(lambda: engine_bytes(state.engine.engine))
                self._hand_over(state)
                state.loads += 1
                state.load_error = None
                self.ever_loaded = True
                log.info(
                    "model %s loaded as %s (%.1f MiB)",
                    state.config.model,
                    state.served_model_name,
                    state.need / 2**20,
                )
                await self._make_room(state)  # measured: it may hold more than its estimate said
                if self.sleep_level:  # /sleep came while it loaded
                    level = self.sleep_level
                    await state.engine.call(lambda e: e.sleep(level), "sleep")
                    state.sleep_level = level
        except Exception as e:  # reported to the requests that wait for it, by /health and /v1/models
            state.load_error = str(e) if isinstance(e, ValueError) else f"{type(e).__name__}: {e}"
            state.load_failures += 1
            log.error("could not load model %s: %s", state.config.model, state.load_error)
            if state is self.default and not self.ever_loaded and self.on_default_error:
                self.on_default_error(state.load_error)
        finally:
            state.loading = None

    def _need(self, state: ServerState) -> int:
        return state.need if state.need is not None else disk_bytes(state.config.model)

    def _over(self, state: ServerState) -> bool:
        others = [s for s in self.loaded() if s is not state]
        if self.budget.max_loaded is not None and len(others) + 1 > self.budget.max_loaded:
            return True
        return (
            self.budget.memory is not None
            and sum(self._need(s) for s in [*others, state]) > self.budget.memory
        )

    async def _make_room(self, state: ServerState) -> None:
        """Unload least recently used models until `state` fits beside the rest (before its load, by its
        estimate; after it, by what it measured)."""
        budget = self.budget.memory
        if budget is not None and self._need(state) > budget:
            message = (
                f"the model `{state.served_model_name}` needs {self._need(state) / 2**20:.1f} MiB, more "
                f"than the server's whole --models-memory budget of {budget / 2**20:.1f} MiB"
            )
            if state.engine is None:
                raise ValueError(message)
            log.warning("%s; it stays loaded, alone", message)  # measured past an estimate that fitted
        while self._over(state):
            others = sorted((s for s in self.loaded() if s is not state), key=lambda s: s.last_used)
            if not others:
                return
            await self._unload(others[0])

    async def _unload(self, state: ServerState) -> None:
        """Let the requests in flight on it finish (new ones wait for its reload), then free it."""
        state.unloading = True
        try:
            while state.users or state.engine.num_in_flight:
                await asyncio.sleep(0.05)
            engine, state.engine = state.engine, None
            await in_daemon_thread(engine.stop)
            device = engine.engine.device
            del engine
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
            log.info("model %s unloaded to make room", state.served_model_name)
        finally:
            state.unloading = False
