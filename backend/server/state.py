"""What the routes share about one served model: its engine once loaded, whether it sleeps, who uses it."""

import asyncio
import time
from dataclasses import dataclass

from backend.config import EngineConfig
from backend.server.async_engine import AsyncEngine
from backend.server.errors import APIError
from backend.server.metrics import ServerMetrics

RETRY_AFTER = {"Retry-After": "5"}

IDLE_STATS = {"running": 0, "waiting": 0, "kv_cache_usage": 0.0, "num_free_blocks": 0, "prefix_cache_queries": 0,
              "prefix_cache_hits": 0, "num_preemptions": 0, "sleeping": 0, "spec_draft_tokens": 0,
              "spec_accepted_tokens": 0, "spec_verifications": 0}


@dataclass(frozen=True)
class RequestPolicy:
    """How the server reads every request, whatever its API (serve's flags of the same names)."""

    tool_call_parser: str | None = None  # None: chosen from the chat template and the model's family
    # "clamp": a max_tokens past the context is cut to what the prompt leaves (as llama.cpp and Anthropic's API
    # do; the answer's x-max-tokens-clamped header says so); "refuse": vLLM's 400 context_length_exceeded
    max_tokens_past_context: str = "clamp"
    # Claude Code's per-request billing line in the system prompt is dropped (it changes every request, and
    # in front of the prompt it would defeat the prefix cache); True keeps it in the prompt
    keep_attribution_header: bool = False
    # how the output's reasoning is told from its answer: "auto" (from the chat template), "none", "think"
    reasoning_parser: str = "auto"
    # seconds a stream may send no content before an empty one keeps clients' watchdogs fed (0: never)
    stream_keepalive: float = 60.0


class ServerState:
    def __init__(self, config: EngineConfig, served_model_name: str, policy: RequestPolicy | None = None,
                 metrics: ServerMetrics | None = None):
        self.config = config
        self.served_model_name = served_model_name
        self.policy = policy or RequestPolicy()
        self.engine: AsyncEngine | None = None
        self.load_error: str | None = None  # why its last load failed (the next request for it loads again)
        self.load_failures = 0
        self.sleep_level = 0
        self.draining = False
        self.metrics = metrics or ServerMetrics(lambda: {served_model_name: self.stats()})
        # Kept by the model registry (backend/server/registry.py):
        self.loading: asyncio.Future | None = None  # the load in progress
        self.unloading = False  # chosen to make room: no new requests until it has been unloaded (and reloaded)
        self.users = 0  # requests holding this model, streams included
        self.waiting = 0  # requests waiting for it to load: the load hands it to them before anything can unload it
        self.handovers = 0  # how many times a load has done so
        self.loads = 0  # how many times it has been loaded since the server started (a high count is thrash)
        self.last_used = time.monotonic()
        self.need: int | None = None  # bytes its engine held when last loaded (weights and KV cache)

    def stats(self) -> dict:
        if self.engine is None:
            return dict(IDLE_STATS)
        return self.engine.engine.stats()

    def loaded_engine(self) -> AsyncEngine:
        """The engine once loaded, asleep or not; 503 + Retry-After while loading."""
        if self.engine is None:
            raise APIError(503, "the model is still loading; retry shortly", type="service_unavailable",
                           headers=RETRY_AFTER)
        return self.engine

    def ready_engine(self) -> AsyncEngine:
        """The engine when it can take requests: loaded and awake."""
        self.loaded_engine()
        if self.sleep_level or self.draining:
            raise APIError(503, "the model is asleep while its memory is lent to another service; retry shortly",
                           type="service_unavailable", headers=RETRY_AFTER)
        return self.engine

    def answers_to(self, name: str) -> bool:
        return name in (self.served_model_name, self.config.model)
