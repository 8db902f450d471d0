"""The router's upstreams (orchestrator/clients/router.py): each one's state, their health (back-off, probes,
Retry-After) and the choice of one for a request, and the outcomes of one attempt."""

import asyncio
import contextlib
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from common import upstreams as board
from orchestrator.clients.llm_client import LLMClient, LLMError
from orchestrator.clients.retries import retry_after


@dataclass
class Upstream:
    client: LLMClient
    models: list[str] | None = None  # None: not asked yet
    in_flight: int = 0
    served: int = 0
    picks: int = 0
    failures: int = 0  # in a row
    ejected_until: float = 0.0  # time.monotonic(); 0: in service
    busy_until: float = 0.0  # a 503/429 with Retry-After: others first until then
    last_failure: float | None = None  # time.time()
    error: str | None = None
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    @property
    def url(self) -> str:
        return self.client.base_url

    def row(self) -> dict:
        ejected = self.ejected_until > time.monotonic()
        return {"url": self.url, "models": self.models or [], "in_flight": self.in_flight, "served": self.served,
                "failures": self.failures, "last_failure": self.last_failure, "error": self.error,
                "ejected_until": time.time() + self.ejected_until - time.monotonic() if ejected else None}


class Failed(Exception):
    """The upstream failed this attempt: it is left out for a back-off and the request may go elsewhere."""

    def __init__(self, message: str, reached: bool = True):
        super().__init__(message)
        self.reached = reached  # False: the request never reached the upstream (connection refused)


@dataclass
class Run:
    """One request's attempts."""
    started: float = field(default_factory=time.monotonic)
    tried: set[str] = field(default_factory=set)
    problems: list[str] = field(default_factory=list)
    retried: bool = False


class Busy(Exception):
    """A 503 or 429 with Retry-After: no failure; the attempt goes elsewhere or waits."""


class Health:
    """Which upstreams may take traffic (back-offs, probes), which one a request goes to, how long to wait when
    none can, and the table ops status reads."""

    def __init__(self, pool: list[Upstream], max_wait: float, connect_wait: float, backoff: float,
                 home: Path | None):
        self.pool, self.max_wait, self.connect_wait, self.backoff = pool, max_wait, connect_wait, backoff
        self.home = home  # where ops status reads the table (common/upstreams.py); None: nowhere
        self._flush: asyncio.TimerHandle | None = None

    def close(self) -> None:
        if self._flush is not None:
            self._flush.cancel()
        if self.home is not None:
            board.remove(self.home)

    def publish(self, now: bool = False) -> None:
        if self.home is None:
            return
        if now or self._flush is None:
            if self._flush is not None:
                self._flush.cancel()
            delay = 0 if now else 0.5
            self._flush = asyncio.get_running_loop().call_later(delay, self._write)

    def _write(self) -> None:
        self._flush = None
        with contextlib.suppress(OSError):  # a status table that cannot be written must not fail a request
            board.write(self.home, [u.row() for u in self.pool])

    async def probe(self, up: Upstream, timeout: float = 5) -> bool:
        try:
            response = await up.client.http.get("/models", timeout=timeout)
            if response.status_code in (429, 503) and "retry-after" in response.headers:
                # alive but loading or busy: no failure, and no traffic until it said to come back
                up.busy_until = time.monotonic() + retry_after(response)
                up.failures, up.ejected_until = 0, 0.0
                self.publish(now=True)
                return True
            response.raise_for_status()
            up.models = [m["id"] for m in response.json().get("data", [])]
        except (httpx.HTTPError, ValueError, KeyError, TypeError) as e:
            self.fail(up, f"probe: {type(e).__name__}: {e}")
            return False
        if up.failures:
            up.failures, up.ejected_until = 0, 0.0
            self.publish(now=True)
        return True

    async def ask_models(self, up: Upstream) -> None:
        """Learn what an upstream serves, once however many requests ask at the same time."""
        async with up.lock:
            now = time.monotonic()
            if up.models is None and up.ejected_until <= now and up.busy_until <= now:
                await self.probe(up)

    def fail(self, up: Upstream, error: str) -> None:
        """Take it out for a back-off; requests failing on it together count as one failure."""
        if up.ejected_until <= time.monotonic():
            up.failures += 1
            up.ejected_until = time.monotonic() + min(self.backoff * 2 ** (up.failures - 1), self.backoff * 16)
        up.last_failure, up.error = time.time(), error
        self.publish(now=True)

    def errors(self) -> str:
        return " | ".join(f"{u.url}: {u.error}" for u in self.pool if u.error) or "no answer"

    async def pick(self, model: str, tried: set[str]) -> Upstream | None:
        """The upstream serving `model` with the fewest requests in flight; ejected ones whose back-off is over
        are probed first. None: every candidate is tried, ejected or busy for now."""
        unknown = [u for u in self.pool if u.models is None and u.ejected_until <= time.monotonic()]
        await asyncio.gather(*(self.ask_models(u) for u in unknown))
        if not any(model in (u.models or []) for u in self.pool):
            known = sorted({m for u in self.pool for m in u.models or []})
            if known or not any(u.models is None for u in self.pool):
                raise LLMError(f"no upstream serves model {model!r}; available: {', '.join(known) or 'none reachable'}")
            return None
        now = time.monotonic()
        ready = []
        for up in self.pool:
            if up.url in tried or model not in (up.models or []) or up.busy_until > now:
                continue
            if up.failures and up.ejected_until > now:
                continue
            if up.failures:  # its back-off is over: probed before it gets traffic again
                async with up.lock:
                    if up.failures and not await self.probe(up):
                        continue
                if up.busy_until > time.monotonic():  # the probe found it loading
                    continue
            ready.append(up)
        if not ready:
            return None
        chosen = min(ready, key=lambda u: (u.in_flight, u.picks))
        chosen.picks += 1
        return chosen

    async def wait(self, model: str, started: float, tried: set[str], problems: list[str]) -> None:
        """Nothing to send to right now: wait for the soonest back-off or Retry-After, within the time allowed."""
        candidates = [u for u in self.pool if model in (u.models or []) or u.models is None]
        soonest = min([u.busy_until for u in candidates if u.busy_until] +
                      [u.ejected_until for u in candidates if u.failures] or [time.monotonic() + 0.5])
        delay = max(0.05, min(soonest - time.monotonic(), 5.0))
        busy = any(u.busy_until > time.monotonic() for u in candidates)
        limit = self.max_wait if busy else self.connect_wait
        if time.monotonic() - started + delay > limit:
            raise LLMError("every LLM upstream failed: " + (" | ".join(problems) or self.errors()) +
                           "; start the backend with `ops up` or check SCRIPTORIUM_LLM_URL")
        tried.clear()
        await asyncio.sleep(delay)
