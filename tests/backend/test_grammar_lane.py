"""Schema compiles run at most LANES at once (server/grammar_lane.py): one refused for its time limit goes on in its
thread holding its lane, a quick schema compiles beside such ones, and one past the lanes waits, its limit counted
from its start. The compiles here are real threads held on events, standing for slow schemas."""

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


def test_a_quick_schema_compiles_beside_slow_ones_refused_for_their_limit():
    assert grammar_lane.LANES == 3
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
        # three refused compiles still run, one a lane: the next one waits for one of them to end
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


def test_a_quick_schema_does_not_wait_for_a_slow_one_within_its_limit():
    """With one lane, a one-property schema waited 60 s behind two slow schemas' refusals."""
    release, ran = threading.Event(), []

    async def scenario():
        slow = asyncio.ensure_future(grammar_lane.compile_in_turn(held(release, ran, "slow"), 60))
        await asyncio.sleep(0.2)
        assert await asyncio.wait_for(grammar_lane.compile_in_turn(lambda: "quick", 60), 30) == "quick"
        assert not slow.done()
        release.set()
        assert await slow == "slow"

    try:
        asyncio.run(scenario())
    finally:
        release.set()


def test_the_limit_counts_from_the_compiles_start_not_from_its_wait_for_a_lane():
    releases = [threading.Event() for _ in range(grammar_lane.LANES)]
    ran: list[str] = []

    async def scenario():
        slow = [asyncio.ensure_future(grammar_lane.compile_in_turn(held(r, ran, f"slow{i}"), 60))
                for i, r in enumerate(releases)]
        await asyncio.sleep(0.2)
        queued = asyncio.ensure_future(grammar_lane.compile_in_turn(lambda: "queued", 0.5))
        await asyncio.sleep(1.0)  # past the queued one's limit, spent waiting for a lane
        assert not queued.done()
        releases[0].set()
        assert await queued == "queued"
        for release in releases:
            release.set()
        assert await asyncio.gather(*slow) == [f"slow{i}" for i in range(len(releases))]

    try:
        asyncio.run(scenario())
    finally:
        for release in releases:
            release.set()


def test_compiles_and_the_threads_they_start_run_below_the_servers_priority():
    """A compile takes the cores a new request's prefill needs unless the scheduler is told it matters less."""
    import os

    def niceness_here_and_in_a_child():
        seen = [os.getpriority(os.PRIO_PROCESS, threading.get_native_id())]
        child = threading.Thread(target=lambda: seen.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id())))
        child.start()
        child.join()
        return seen

    server = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    seen = asyncio.run(grammar_lane.compile_in_turn(niceness_here_and_in_a_child, 60))
    assert seen == [max(server, grammar_lane.COMPILE_NICENESS)] * 2
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == server
