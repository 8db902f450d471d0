"""A soak: 200 concurrent streaming requests, half hanging up at random, twice. No 5xx, no leaked KV
block or request, and memory that does not grow from one round to the next."""

import asyncio

from tests.reliability.server_state import rss_bytes
from tests.reliability.soak import settle, soak_round


def test_200_concurrent_streams_with_random_hang_ups_leak_nothing(poison_server):
    url, pid = poison_server.url, poison_server.proc.pid
    first = asyncio.run(soak_round(url, requests=200, max_tokens=8, seed=1))
    assert first.errors == [] and set(first.statuses) == {200}, (first.statuses, first.errors[:3])
    assert first.disconnected > 50 and first.completed > 50
    assert settle(url) == {"running": 0, "waiting": 0, "kv_cache_usage": 0}
    before = rss_bytes(pid)
    second = asyncio.run(soak_round(url, requests=200, max_tokens=8, seed=1))
    assert second.errors == [] and set(second.statuses) == {200}, (second.statuses, second.errors[:3])
    assert settle(url) == {"running": 0, "waiting": 0, "kv_cache_usage": 0}
    assert rss_bytes(pid) <= 1.1 * before
