"""A soak round: many concurrent streaming chat requests, some of whose clients hang up part way.

Used by tests/reliability/test_soak.py (CI) and bench/reliability_under_load.py (figures over time).
"""

import asyncio
import json
import random
import time
from dataclasses import dataclass, field

import httpx


@dataclass
class SoakResult:
    requests: int = 0
    completed: int = 0
    disconnected: int = 0
    statuses: dict[int, int] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)  # 5xx responses and in-band stream errors
    seconds: float = 0.0


async def _one(client: httpx.AsyncClient, url: str, index: int, hang_up_after: int | None, max_tokens: int,
               result: SoakResult) -> None:
    body = {"stream": True, "max_tokens": max_tokens, "temperature": 0.8, "seed": index,
            "ignore_eos": True, "messages": [{"role": "user", "content": f"request {index}: copy the page"}]}
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
        result.statuses[response.status_code] = result.statuses.get(response.status_code, 0) + 1
        if response.status_code >= 500:
            result.errors.append(f"{response.status_code}: {(await response.aread())[:200]!r}")
            return
        chunks = 0
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                result.errors.append(f"in-band: {event['error']['message'][:200]}")
                return
            chunks += 1
            if hang_up_after is not None and chunks >= hang_up_after:
                result.disconnected += 1
                return  # leaving the block closes the connection mid-stream
        result.completed += 1


async def soak_round(url: str, requests: int = 200, max_tokens: int = 8, seed: int = 0) -> SoakResult:
    """`requests` concurrent streams; about half hang up after a random number of chunks."""
    rng = random.Random(seed)
    plan = [rng.randint(1, max_tokens) if rng.random() < 0.5 else None for _ in range(requests)]
    result = SoakResult(requests=requests)
    limits = httpx.Limits(max_connections=requests, max_keepalive_connections=0)
    start = time.monotonic()
    async with httpx.AsyncClient(timeout=300, limits=limits) as client:
        await asyncio.gather(*(_one(client, url, i, hang, max_tokens, result) for i, hang in enumerate(plan)))
    result.seconds = time.monotonic() - start
    return result


def settle(url: str, timeout: float = 30.0) -> dict[str, float]:
    """Wait until the server has let go of every request (aborts arrive a moment after hang-ups)."""
    from tests.reliability.server_state import idle

    deadline = time.monotonic() + timeout
    state = idle(url)
    while any(state.values()) and time.monotonic() < deadline:
        time.sleep(0.1)
        state = idle(url)
    return state
