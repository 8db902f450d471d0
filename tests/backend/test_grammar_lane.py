"""Schema compiles take turns on the grammar lane (server/grammar_lane.py): one refused for its time limit goes on
in its thread and hands the lane to the next, so a quick schema does not wait behind refused ones; at most
OVERRUNS of them go on at once. The compiles here are real threads held on events, standing for slow schemas."""

import asyncio
import threading

import pytest

from backend.server import grammar_lane


def held(release: threading.Event, ran: list[str], name: str):
    def compile_schema():
        ran.append(name)
        assert release.wait(120), "the test never let this compile end"
        return name

    return compile_schema


def test_a_quick_schema_does_not_wait_behind_compiles_refused_for_their_limit():
    assert grammar_lane.OVERRUNS == 2
    ran: list[str] = []
    releases = {name: threading.Event() for name in "abc"}

    async def scenario():
        for name in "ab":  # two slow schemas, each refused at its limit while it goes on compiling
            with pytest.raises(TimeoutError):
                await grammar_lane.compile_in_turn(held(releases[name], ran, name), 0.2)
        assert await grammar_lane.compile_in_turn(lambda: "quick", 60) == "quick"
        assert not releases["a"].is_set() and ran == ["a", "b"]  # both still compiling: it did not wait for them
        with pytest.raises(TimeoutError):
            await grammar_lane.compile_in_turn(held(releases["c"], ran, "c"), 0.2)
        # three refused compiles still run: the next one waits for one of them to end
        late = asyncio.ensure_future(grammar_lane.compile_in_turn(lambda: "late", 60))
        await asyncio.sleep(0.5)
        assert not late.done()
        releases["a"].set()
        assert await asyncio.wait_for(late, 60) == "late"

    try:
        asyncio.run(scenario())
    finally:
        for release in releases.values():
            release.set()


def test_the_limit_counts_from_the_compiles_start_not_from_its_wait_in_the_queue():
    release = threading.Event()
    ran: list[str] = []

    async def scenario():
        slow = asyncio.ensure_future(grammar_lane.compile_in_turn(held(release, ran, "slow"), 60))
        await asyncio.sleep(0.2)
        queued = asyncio.ensure_future(grammar_lane.compile_in_turn(lambda: "queued", 0.5))
        await asyncio.sleep(1.0)  # past the queued one's limit, spent waiting for the lane
        assert not queued.done()
        release.set()
        assert await slow == "slow" and await queued == "queued"

    try:
        asyncio.run(scenario())
    finally:
        release.set()
