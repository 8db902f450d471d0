"""When a call to an LLM upstream is tried again, and after how long: the one place that decides it. LLMClient
asks it between its attempts on one upstream; LLMRouter reads Retry-After through it when it spreads attempts
over several.

A 429 or 5xx, or a transfer broken before any answer, is retried with exponential back-off (0.5 s doubling up
to 20 s, jittered) at most `max_retries` times; a 503 or 429 with Retry-After (our backend asleep for
ComfyUI, or loading) waits what it names (at most a minute a time) and a 503 is waited out without counting
against max_retries; a refused connection (nothing listens) is retried only for `connect_wait` seconds, so
interactive callers hear at once that the server is not running. Nothing waits past `max_wait`.
"""

import asyncio
import random
import time
from dataclasses import dataclass, field

import httpx

RETRYABLE = {429, 500, 502, 503, 504}


def retry_after(response: httpx.Response) -> float | None:
    """Seconds its Retry-After asks for (at most a minute; 1 s when it is a date), None without one."""
    if "retry-after" not in response.headers:
        return None
    try:
        return min(float(response.headers["retry-after"]), 60.0)
    except ValueError:
        return 1.0


class GiveUp(Exception):
    """No attempt is left: the message says how many were made, over how long, and the last problem."""


@dataclass
class Retries:
    """One call's attempts on one upstream."""
    max_wait: float
    max_retries: int
    connect_wait: float
    started: float = field(default_factory=time.monotonic)
    attempt: int = 0

    def _backoff(self) -> float:
        return min(0.5 * 2 ** self.attempt, 20.0) * (0.5 + random.random() / 2)

    async def after_failure(self, problem: str, response: httpx.Response | None = None,
                            longest: float | None = None) -> None:
        """Wait before the next attempt (at most `longest` seconds, when given), or raise GiveUp."""
        named = retry_after(response) if response is not None else None
        delay = named if named is not None else self._backoff()
        delay = delay if longest is None else min(delay, longest)
        waited = time.monotonic() - self.started
        waiting_out = response is not None and response.status_code == 503
        if self.attempt >= self.max_retries and not waiting_out or waited + delay > self.max_wait:
            raise GiveUp(f"failed after {self.attempt + 1} attempts over {waited:.0f} s (last: {problem})")
        self.attempt += 1
        await asyncio.sleep(delay)

    async def after_refused(self, problem: str) -> bool:
        """Wait before connecting again (or raise GiveUp as after_failure); False when connect_wait is spent:
        nothing is listening."""
        left = self.connect_wait - (time.monotonic() - self.started)
        if left <= 0:
            return False
        await self.after_failure(problem, longest=left)
        return True
