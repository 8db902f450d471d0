"""One upstream as the router (orchestrator/clients/router.py) keeps it, and the outcomes of one attempt."""

import asyncio
import time
from dataclasses import dataclass, field

from orchestrator.clients.llm import LLMClient


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
