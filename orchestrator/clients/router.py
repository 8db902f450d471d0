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
from collections.abc import AsyncIterator
from pathlib import Path

import httpx

from common import upstreams as board
from orchestrator.clients.llm import (
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
from orchestrator.clients.upstream import Busy, Failed, Run, Upstream


class LLMRouter:
    def __init__(self, urls: list[str] | tuple[str, ...], model: str | None = None, api_key: str | None = None,
                 timeout: float = 600.0, max_wait: float = 600.0, connect_wait: float = 30.0, backoff: float = 5.0,
                 home: Path | None = None):
        if not urls:
            raise LLMError("no LLM upstream configured; set SCRIPTORIUM_LLM_URL")
        retries = 8 if len(urls) == 1 else 0
        self.pool = [Upstream(LLMClient(u, None, api_key, timeout, max_wait, retries, connect_wait)) for u in urls]
        self.clients = [u.client for u in self.pool]
        self.model, self.max_wait, self.connect_wait, self.backoff = model, max_wait, connect_wait, backoff
        self.home = home  # where ops status reads this router's table (common/upstreams.py); None: nowhere
        self.windows: dict[str, int | None] = {}  # model -> its context as /models lists it (clients/context.py)
        self._flush: asyncio.TimerHandle | None = None

    @property
    def base_url(self) -> str:
        return ", ".join(u.url for u in self.pool)

    async def aclose(self) -> None:
        if self._flush is not None:
            self._flush.cancel()
        if self.home is not None:
            board.remove(self.home)
        for client in self.clients:
            await client.aclose()

    async def __aenter__(self) -> "LLMRouter":
        return self

    async def __aexit__(self, *_) -> None:
        await self.aclose()

    # --- what ops status and stack_status show -----------------------------------------------------------
    def _publish(self, now: bool = False) -> None:
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

    async def _probe(self, up: Upstream, timeout: float = 5) -> bool:
        try:
            response = await up.client.http.get("/models", timeout=timeout)
            if response.status_code in (429, 503) and "retry-after" in response.headers:
                # alive but loading or busy: no failure, and no traffic until it said to come back
                up.busy_until = time.monotonic() + retry_after(response)
                up.failures, up.ejected_until = 0, 0.0
                self._publish(now=True)
                return True
            response.raise_for_status()
            up.models = [m["id"] for m in response.json().get("data", [])]
        except (httpx.HTTPError, ValueError, KeyError, TypeError) as e:
            self._fail(up, f"probe: {type(e).__name__}: {e}")
            return False
        if up.failures:
            up.failures, up.ejected_until = 0, 0.0
            self._publish(now=True)
        return True

    async def _ask_models(self, up: Upstream) -> None:
        """Learn what an upstream serves, once however many requests ask at the same time."""
        async with up.lock:
            now = time.monotonic()
            if up.models is None and up.ejected_until <= now and up.busy_until <= now:
                await self._probe(up)

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
                healthy = up.ejected_until <= time.monotonic() and await self._probe(up)
                error = None if healthy else up.error
            return {**up.row(), "healthy": healthy, "error": error}

        return list(await asyncio.gather(*(ask(u) for u in self.pool)))

    async def models(self) -> list[str]:
        seen = []
        for row in await self.upstreams():
            seen += [m for m in row["models"] if m not in seen]
        return seen

    # --- choosing -----------------------------------------------------------------------------------------
    def _fail(self, up: Upstream, error: str) -> None:
        """Take it out for a back-off; requests failing on it together count as one failure."""
        if up.ejected_until <= time.monotonic():
            up.failures += 1
            up.ejected_until = time.monotonic() + min(self.backoff * 2 ** (up.failures - 1), self.backoff * 16)
        up.last_failure, up.error = time.time(), error
        self._publish(now=True)

    async def _resolve(self, model: str | None) -> str:
        if model or self.model:
            return model or self.model
        for up in self.pool:
            await self._ask_models(up)
            if up.models:
                self.model = up.models[0]
                return self.model
        raise LLMError(f"no LLM upstream answers /models ({self._errors()}); start the backend with `ops up` or "
                       "check SCRIPTORIUM_LLM_URL")

    def _errors(self) -> str:
        return " | ".join(f"{u.url}: {u.error}" for u in self.pool if u.error) or "no answer"

    async def _pick(self, model: str, tried: set[str]) -> Upstream | None:
        """The upstream serving `model` with the fewest requests in flight; ejected ones whose back-off is over
        are probed first. None: every candidate is tried, ejected or busy for now."""
        unknown = [u for u in self.pool if u.models is None and u.ejected_until <= time.monotonic()]
        await asyncio.gather(*(self._ask_models(u) for u in unknown))
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
                    if up.failures and not await self._probe(up):
                        continue
                if up.busy_until > time.monotonic():  # the probe found it loading
                    continue
            ready.append(up)
        if not ready:
            return None
        chosen = min(ready, key=lambda u: (u.in_flight, u.picks))
        chosen.picks += 1
        return chosen

    async def _wait(self, model: str, started: float, tried: set[str], problems: list[str]) -> None:
        """Nothing to send to right now: wait for the soonest back-off or Retry-After, within the time allowed."""
        candidates = [u for u in self.pool if model in (u.models or []) or u.models is None]
        soonest = min([u.busy_until for u in candidates if u.busy_until] +
                      [u.ejected_until for u in candidates if u.failures] or [time.monotonic() + 0.5])
        delay = max(0.05, min(soonest - time.monotonic(), 5.0))
        busy = any(u.busy_until > time.monotonic() for u in candidates)
        limit = self.max_wait if busy else self.connect_wait
        if time.monotonic() - started + delay > limit:
            raise LLMError("every LLM upstream failed: " + (" | ".join(problems) or self._errors()) +
                           "; start the backend with `ops up` or check SCRIPTORIUM_LLM_URL")
        tried.clear()
        await asyncio.sleep(delay)

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
            up = await self._pick(model, run.tried)
            if up is not None:
                up.in_flight += 1
                self._publish()
                return up
            await self._wait(model, run.started, run.tried, run.problems)

    def _done(self, up: Upstream) -> None:
        up.in_flight -= 1
        self._publish()

    def _failed(self, up: Upstream, failure: "Failed", run: "Run") -> None:
        """Take the upstream out; raise when the request may not be tried again (once, when it reached one)."""
        self._fail(up, str(failure))
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
        self._publish()
        try:
            yield up.client
            up.served += 1
        except LLMError as e:
            if " answered 4" not in str(e):
                up.last_failure, up.error = time.time(), str(e)
            raise
        finally:
            up.in_flight -= 1
            self._publish()

    async def chat(self, messages: list[dict], model: str | None = None, **kwargs) -> dict:
        if len(self.pool) == 1:
            async with self._alone() as client:
                return await client.chat(messages, model=model or self.model, **kwargs)
        model = await self._resolve(model)
        body, run = chat_body(model, messages, **kwargs), Run()
        while True:
            up = await self._next(model, run)
            try:
                try:
                    response = await up.client.http.post("/chat/completions", json=body)
                except httpx.ConnectError as e:
                    raise Failed(f"{up.url}: {type(e).__name__}: {e or 'connection refused'}", False) from None
                except httpx.TransportError as e:
                    raise Failed(f"{up.url}: {type(e).__name__}: {e}") from None
                if response.status_code >= 400:
                    self._classify(up, response)
                up.served += 1
                return chat_result(up.url, response.json())
            except Busy:
                continue
            except Failed as failure:
                self._failed(up, failure, run)
            finally:
                self._done(up)

    async def stream_chat(self, messages: list[dict], model: str | None = None, info: StreamInfo | None = None,
                          **kwargs) -> AsyncIterator[str]:
        """Text deltas; info (when given) takes the answering model and the server's token count."""
        if len(self.pool) == 1:
            async with self._alone() as client:
                async for delta in client.stream_chat(messages, info=info, model=model or self.model, **kwargs):
                    yield delta
            return
        model = await self._resolve(model)
        body, run = {**chat_body(model, messages, **kwargs), **stream_body(info)}, Run()
        while True:
            up = await self._next(model, run)
            yielded, error = False, None
            try:
                try:
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
                                    self._fail(up, str(e))
                                    raise
                                raise Failed(f"{up.url}: {e}") from None
                            if deltas is None:
                                up.served += 1
                                return
                            for delta in deltas:
                                yielded = True
                                yield delta
                except httpx.ConnectError as e:
                    raise Failed(f"{up.url}: {type(e).__name__}: {e or 'connection refused'}", False) from None
                except httpx.TransportError as e:
                    error = e
                if yielded:  # part of the answer is out: asking elsewhere would repeat it
                    self._fail(up, f"stream broke off: {error or 'no data: [DONE]'}")
                    raise broken_stream(up.url, error)
                raise Failed(f"{up.url}: the stream ended before any text ({error or 'no data: [DONE]'})")
            except Busy:
                continue
            except Failed as failure:
                self._failed(up, failure, run)
            finally:
                self._done(up)
