"""How the router chooses among real backends serving the same model: the fewest requests in flight, a failed
upstream left out for a doubling back-off and probed before it gets traffic again, a non-streamed request retried
once (never twice), and an upstream still loading (503 + Retry-After) waited for instead of failed.

The oracle is what reached each backend, recorded at its listener (tests/orchestrator/inprocess_backend.py)."""

import asyncio
import time

import httpx
import pytest

from orchestrator.clients.llm_client import LLMError
from orchestrator.clients.router import LLMRouter
from orchestrator.clients.upstream import Upstream
from tests.orchestrator.inprocess_backend import InProcessBackend

PROMPT = [{"role": "user", "content": "Write about quills."}]
CHAT = ("POST", "/v1/chat/completions")
MODELS = ("GET", "/v1/models")


@pytest.fixture
def backends(tiny_dir):
    made: list[InProcessBackend] = []

    def make(n: int) -> list[InProcessBackend]:
        made.extend(InProcessBackend(str(tiny_dir("llama"))) for _ in range(n))
        return made[-n:]

    yield make
    for backend in made:
        backend.stop()


def urls(*backends: InProcessBackend) -> list[str]:
    return [f"{b.url}/v1" for b in backends]


def back_off(up: Upstream) -> float:
    """The back-off its last failure started, in seconds (measured from the failure, not from now)."""
    failed_at = time.monotonic() - (time.time() - up.last_failure)
    return up.ejected_until - failed_at


def break_engine(backend: InProcessBackend) -> None:
    """Stop its engine loop the way a bug would: chats then answer 503 without Retry-After (restart the server)."""
    engine = backend.state.engine

    def broken(command):
        raise RuntimeError("simulated bug in the engine loop")

    engine._run_command = broken
    engine._submit(("abort", "nothing"))
    deadline = time.monotonic() + 10
    while engine.died is None:
        assert time.monotonic() < deadline, "the engine loop did not stop"
        time.sleep(0.02)
    answer = httpx.post(
        f"{backend.url}/v1/chat/completions", json={"messages": PROMPT, "max_tokens": 2}, timeout=10
    )
    assert (
        answer.status_code == 503 and "retry-after" not in answer.headers
    )  # a failure, not "come back later"
    backend.calls.clear()


def test_each_request_goes_to_the_upstream_with_the_fewest_in_flight(backends):
    a, b, c = backends(3)

    async def scenario():
        async with LLMRouter(urls(a, b, c), model="tiny") as router:
            held = []  # streams kept open after their first text: in flight until closed
            try:
                for _ in range(4):
                    stream = router.stream_chat(PROMPT, max_tokens=32)
                    await anext(stream)
                    held.append(stream)
                # one each, then the fourth to the first of three equally loaded
                assert [x.posts() for x in (a, b, c)] == [2, 1, 1]
                await held[1].aclose()  # b has none in flight now
                for _ in range(3):
                    await router.chat(PROMPT, max_tokens=2)
                assert [x.posts() for x in (a, b, c)] == [2, 4, 1]  # all three to b, one after another
                await held[2].aclose()  # in flight: a 2, b 0, c 0
                await asyncio.gather(*(router.chat(PROMPT, max_tokens=2) for _ in range(4)))
                assert [x.posts() for x in (a, b, c)] == [2, 6, 3]  # two each to b and c, none to a
                assert [u.in_flight for u in router.pool] == [2, 0, 0]
            finally:
                for stream in held:
                    await stream.aclose()
            assert [u.in_flight for u in router.pool] == [0, 0, 0]

    asyncio.run(scenario())


def test_a_failed_upstream_is_left_out_for_a_doubling_back_off_and_probed_before_it_gets_traffic(backends):
    flaky, steady = backends(2)

    async def scenario():
        async with LLMRouter(urls(flaky, steady), model="tiny", backoff=1.0, connect_wait=10) as router:
            up = router.pool[0]
            await router.chat(PROMPT, max_tokens=2)  # a tie: the first one
            assert (flaky.posts(), steady.posts()) == (1, 0)
            flaky.close()
            for _ in range(2):  # the second goes to flaky, is refused, and completes on steady
                assert (await router.chat(PROMPT, max_tokens=2))["usage"]["completion_tokens"] > 0
            assert steady.posts() == 2 and up.failures == 1 and "ConnectError" in up.error
            assert back_off(up) == pytest.approx(1.0, abs=0.05)

            await asyncio.sleep(up.ejected_until - time.monotonic() + 0.05)
            await router.chat(PROMPT, max_tokens=2)  # its back-off is over: probed, still refused
            assert up.failures == 2 and up.error.startswith("probe:")
            assert back_off(up) == pytest.approx(2.0, abs=0.05)  # doubled
            assert steady.posts() == 3

            flaky.open()
            seen = len(flaky.calls)
            skipped = 0
            while up.ejected_until - time.monotonic() > 0.3:  # listening again, but left out until its time
                await router.chat(PROMPT, max_tokens=2)
                skipped += 1
            assert skipped and len(flaky.calls) == seen and steady.posts() == 3 + skipped

            await asyncio.sleep(up.ejected_until - time.monotonic() + 0.05)
            await router.chat(PROMPT, max_tokens=2)
            assert flaky.calls[seen:] == [MODELS, CHAT]  # probed first, then the request
            assert up.failures == 0 and up.ejected_until == 0

    asyncio.run(scenario())


def test_a_non_streamed_request_is_retried_once_and_a_stream_before_its_first_text(backends):
    x, y, z = backends(3)
    break_engine(x)
    break_engine(y)

    async def scenario():
        async with LLMRouter(urls(x, y, z), model="tiny", backoff=30) as router:
            with pytest.raises(LLMError, match="the request failed on two upstreams") as failure:
                await router.chat(PROMPT, max_tokens=2)
            assert "answered 503" in str(failure.value) and "restart the server" in str(failure.value)
            assert [b.posts() for b in (x, y, z)] == [1, 1, 0]  # retried once, not on every upstream
            assert [u.failures for u in router.pool] == [1, 1, 0]
            result = await router.chat(PROMPT, max_tokens=2)  # the two failed ones are left out
            assert result["usage"]["completion_tokens"] > 0 and [b.posts() for b in (x, y, z)] == [1, 1, 1]

        async with LLMRouter(urls(x, z), model="tiny") as router:
            result = await router.chat(PROMPT, max_tokens=2)  # x first, fails; once more, on z
            assert result["usage"]["completion_tokens"] > 0 and (x.posts(), z.posts()) == (2, 2)
        async with LLMRouter(urls(x, z), model="tiny") as router:
            text = "".join([d async for d in router.stream_chat(PROMPT, max_tokens=8)])
            assert text and (x.posts(), z.posts()) == (3, 3)  # no text had gone out: asked elsewhere

    asyncio.run(scenario())


def test_an_upstream_still_loading_is_waited_for_and_probed_again_not_failed(backends):
    a, b = backends(2)
    engines = [a.state.engine, b.state.engine]
    registries = [a.app.state.registry, b.app.state.registry]
    a.state.engine = b.state.engine = None  # what the server is while its first model loads
    for r in registries:
        r.ever_loaded = False
    loading = httpx.get(f"{a.url}/v1/models", timeout=5)
    assert loading.status_code == 503 and loading.headers["retry-after"] == "5"
    a.calls.clear()

    async def scenario():
        async with LLMRouter(urls(a, b), model="tiny", connect_wait=1, max_wait=60) as router:
            request = asyncio.create_task(router.chat(PROMPT, max_tokens=2))
            await asyncio.sleep(2)  # past connect_wait: a failure would have ended the request by now
            assert not request.done() and [u.failures for u in router.pool] == [0, 0]
            assert a.calls == [MODELS] and b.calls == [MODELS]  # asked once, then left alone as it said
            a.state.engine, b.state.engine = engines
            for r in registries:
                r.ever_loaded = True
            result = await asyncio.wait_for(request, 30)
            assert result["usage"]["completion_tokens"] > 0
            # Probed again once its Retry-After ran out, then used. The two Retry-Afters end a moment apart (in
            # the order the first answers came): the other one is probed again only if the router woke after both.
            used, other = (a, b) if CHAT in a.calls else (b, a)
            assert used.calls == [MODELS, MODELS, CHAT] and other.calls in ([MODELS], [MODELS, MODELS])

        async with LLMRouter(urls(a, b), model="tiny", backoff=0.5) as router:
            up = router.pool[0]
            await router.chat(PROMPT, max_tokens=2)  # a knows its model now
            a.close()
            a.state.engine, registries[0].ever_loaded = None, False  # restarted: loading its model
            await router.chat(PROMPT, max_tokens=2)  # to b (fewer picks)
            await router.chat(PROMPT, max_tokens=2)  # to a: refused, then b
            assert up.failures == 1
            a.open()  # back, and loading
            seen = len(a.calls)
            await asyncio.sleep(up.ejected_until - time.monotonic() + 0.05)
            await router.chat(PROMPT, max_tokens=2)
            assert a.calls[seen:] == [
                MODELS
            ]  # probed: alive but loading, so no request and no longer back-off
            assert up.failures == 0 and up.ejected_until == 0 and up.busy_until > time.monotonic()

    try:
        asyncio.run(scenario())
    finally:
        a.state.engine, b.state.engine = engines
        for r in registries:
            r.ever_loaded = True
