"""Several OpenAI-compatible upstreams as one (SCRIPTORIUM_LLM_URL lists them).

A request goes to an upstream serving its model (each is asked through /models), the one with the fewest requests
in flight. An upstream that fails (refused connection, broken transfer, a 5xx other than 503 + Retry-After) is taken
out for a back-off that doubles with each failure in a row (SCRIPTORIUM_LLM_BACKOFF up to 16 times that) and is
probed (GET /models) before it gets traffic again. A 503 or 429 with Retry-After (a backend asleep for ComfyUI, or
loading) is no failure, also when a probe gets it: other upstreams take the traffic until the time it names, or,
with no other, it is waited out (for max_wait, not the shorter connect_wait of a refused connection).

A non-streamed request that fails is retried once on another upstream (more often when the connection was refused,
since then it never reached one); a stream is retried only before its first text (a server-side error sent inside
the stream before then counts as that upstream failing), and one that breaks off later fails with an error saying
the answer is incomplete. With a single upstream the client's own retries apply.
"""

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import httpx

from orchestrator.clients.llm_client import (
    LLMClient,
    LLMError,
    StreamError,
    StreamInfo,
    _message,
    broken_stream,
    chat_body,
    chat_result,
    stream_body,
    stream_deltas,
)
from orchestrator.clients.retries import retry_after
from orchestrator.clients.upstream import Busy, Failed, Health, Run, Upstream


class LLMRouter:
    def __init__(self, urls: list[str] | tuple[str, ...], model: str | None = None, api_key: str | None = None,
                 timeout: float = 600.0, max_wait: float = 600.0, connect_wait: float = 30.0, backoff: float = 5.0,
                 home: Path | None = None):
        if not urls:
            raise LLMError("no LLM upstream configured; set SCRIPTORIUM_LLM_URL")
        retries = 8 if len(urls) == 1 else 0
        self.pool = [Upstream(LLMClient(u, None, api_key, timeout, max_wait, retries, connect_wait)) for u in urls]
        self.clients = [u.client for u in self.pool]
        self.model = model
        self.health = Health(self.pool, max_wait, connect_wait, backoff, home)
        self.windows: dict[str, int | None] = {}  # model -> its context as /models lists it (clients/completion_budget.py)

    @property
    def base_url(self) -> str:
        return ", ".join(u.url for u in self.pool)

    async def aclose(self) -> None:
        self.health.close()
        for client in self.clients:
            await client.aclose()

    async def __aenter__(self) -> "LLMRouter":
        return self

    async def __aexit__(self, *_) -> None:
        await self.aclose()

    async def upstreams(self) -> list[dict]:
        """Every upstream, asked now: health, models, requests in flight, when it last failed and why."""
        async def ask(up: Upstream) -> dict:
            if len(self.pool) == 1:
                try:
                    up.models = await asyncio.wait_for(up.client.models(), timeout=10)
                    healthy, error = True, None
                except (TimeoutError, LLMError) as e:
                    healthy, error = False, str(e) or "timeout"
            else:
                healthy = up.ejected_until <= time.monotonic() and await self.health.probe(up)
                error = None if healthy else up.error
            return {**up.row(), "healthy": healthy, "error": error}

        return list(await asyncio.gather(*(ask(u) for u in self.pool)))

    async def models(self) -> list[str]:
        seen = []
        for row in await self.upstreams():
            seen += [m for m in row["models"] if m not in seen]
        return seen

    # --- choosing ---------------------------------------------------------------------------------------------
    async def _resolve(self, model: str | None) -> str:
        if model or self.model:
            return model or self.model
        for up in self.pool:
            await self.health.ask_models(up)
            if up.models:
                self.model = up.models[0]
                return self.model
        raise LLMError(f"no LLM upstream answers /models ({self.health.errors()}); start the backend with `ops up` or "
                       "check SCRIPTORIUM_LLM_URL")

    # --- requests -----------------------------------------------------------------------------------------
    def _classify(self, up: Upstream, response: httpx.Response) -> None:
        """Raise for an answer that is not a success: LLMError (the request's fault), Failed, or mark it busy."""
        status = response.status_code
        if status in (429, 503) and "retry-after" in response.headers:
            up.busy_until = time.monotonic() + retry_after(response)
            raise Busy()
        if status >= 500 or status == 429:
            raise Failed(f"{up.url} answered {status}: {_message(response)}")
        raise LLMError(f"{up.url}/chat/completions answered {status}: {_message(response)}")

    async def _next(self, model: str, run: "Run") -> Upstream:
        """The upstream for the next attempt (waiting while none can take it), counted as in flight."""
        while True:
            up = await self.health.pick(model, run.tried)
            if up is not None:
                up.in_flight += 1
                self.health.publish()
                return up
            await self.health.wait(model, run.started, run.tried, run.problems)

    def _done(self, up: Upstream) -> None:
        up.in_flight -= 1
        self.health.publish()

    def _failed(self, up: Upstream, failure: "Failed", run: "Run") -> None:
        """Take the upstream out; raise when the request may not be tried again (once, when it reached one)."""
        self.health.fail(up, str(failure))
        run.problems.append(str(failure))
        run.tried.add(up.url)
        if failure.reached:
            if run.retried:
                raise LLMError(f"the request failed on two upstreams: {' | '.join(run.problems)}") from None
            run.retried = True

    @contextlib.asynccontextmanager
    async def _alone(self):
        """One upstream: its client retries as it does; the router only keeps the counts."""
        up = self.pool[0]
        up.in_flight += 1
        self.health.publish()
        try:
            yield up.client
            up.served += 1
        except LLMError as e:
            if " answered 4" not in str(e):
                up.last_failure, up.error = time.time(), str(e)
            raise
        finally:
            up.in_flight -= 1
            self.health.publish()

    async def _routed(self, model: str, attempt: Callable[[Upstream], AsyncIterator]) -> AsyncIterator:
        """What attempt(upstream) yields, from the upstream each attempt goes to: the one retry loop of chat and
        stream_chat. attempt raises Busy or Failed (through _classify) for an answer that is not a success; a
        transfer that breaks is a failure of that upstream, unless part of the answer is out (asking elsewhere would
        repeat it), which ends the request."""
        run = Run()
        while True:
            up = await self._next(model, run)
            yielded = False
            try:
                try:
                    async for item in attempt(up):
                        yielded = True
                        yield item
                    return
                except httpx.ConnectError as e:
                    raise Failed(f"{up.url}: {type(e).__name__}: {e or 'connection refused'}", False) from None
                except httpx.TransportError as e:
                    if yielded:
                        self.health.fail(up, f"stream broke off: {e}")
                        raise broken_stream(up.url, e) from None
                    raise Failed(f"{up.url}: {type(e).__name__}: {e}") from None
            except Busy:
                continue
            except Failed as failure:
                self._failed(up, failure, run)
            finally:
                self._done(up)

    async def chat(self, messages: list[dict], model: str | None = None, **kwargs) -> dict:
        if len(self.pool) == 1:
            async with self._alone() as client:
                return await client.chat(messages, model=model or self.model, **kwargs)
        model = await self._resolve(model)
        body = chat_body(model, messages, **kwargs)

        async def attempt(up: Upstream) -> AsyncIterator[dict]:
            response = await up.client.http.post("/chat/completions", json=body)
            if response.status_code >= 400:
                self._classify(up, response)
            result = chat_result(up.url, response.json())
            up.served += 1
            yield result

        async with contextlib.aclosing(self._routed(model, attempt)) as results:
            return await anext(results)

    async def stream_chat(self, messages: list[dict], model: str | None = None, info: StreamInfo | None = None,
                          **kwargs) -> AsyncIterator[str]:
        """Text deltas; info (when given) takes the answering model and the server's token count."""
        if len(self.pool) == 1:
            async with self._alone() as client:
                async for delta in client.stream_chat(messages, info=info, model=model or self.model, **kwargs):
                    yield delta
            return
        model = await self._resolve(model)
        body = {**chat_body(model, messages, **kwargs), **stream_body(info)}

        async def attempt(up: Upstream) -> AsyncIterator[str]:
            yielded = False
            async with up.client.http.stream("POST", "/chat/completions", json=body) as response:
                if response.status_code >= 400:
                    await response.aread()
                    self._classify(up, response)
                async for line in response.aiter_lines():
                    try:
                        deltas = stream_deltas(line, info)
                    except StreamError as e:
                        if not e.server_side:
                            raise
                        if yielded:
                            self.health.fail(up, str(e))
                            raise
                        raise Failed(f"{up.url}: {e}") from None
                    if deltas is None:
                        up.served += 1
                        return
                    for delta in deltas:
                        yielded = True
                        yield delta
            if yielded:  # it ended without data: [DONE]
                self.health.fail(up, "stream broke off: no data: [DONE]")
                raise broken_stream(up.url, None)
            raise Failed(f"{up.url}: the stream ended before any text (no data: [DONE])")

        async with contextlib.aclosing(self._routed(model, attempt)) as deltas:
            async for delta in deltas:
                yield delta
