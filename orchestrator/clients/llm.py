"""An async client for any OpenAI-compatible server (ours, vLLM, SGLang, Ollama, llama.cpp, ...).

Retries with exponential backoff on 429, 5xx and dropped connections; a 503 with Retry-After
(our backend while it sleeps for ComfyUI, or loading) is waited out rather than reported as a
failure. A refused connection (nothing listens) is retried only for `connect_wait` seconds:
interactive callers (the MCP server) pass 0 and hear at once that the server is not running.
"""

import asyncio
import json
import random
import time
from collections.abc import AsyncIterator

import httpx


class LLMError(Exception):
    pass


RETRYABLE = {429, 500, 502, 503, 504}


class LLMClient:
    def __init__(self, base_url: str, model: str | None = None, api_key: str | None = None, timeout: float = 600.0,
                 max_wait: float = 600.0, max_retries: int = 8, connect_wait: float = 30.0):
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.connect_wait = connect_wait  # how long a refused connection is retried (a restarting server)
        self.max_wait = max_wait  # the longest a call keeps retrying before it gives up
        self.max_retries = max_retries  # for connection errors and 429/5xx; a sleeping backend's 503 is waited out
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.AsyncClient(base_url=self.base_url, headers=headers,
                                      timeout=httpx.Timeout(timeout, connect=10.0))

    async def aclose(self) -> None:
        await self.http.aclose()

    async def __aenter__(self) -> "LLMClient":
        return self

    async def __aexit__(self, *_) -> None:
        await self.aclose()

    def _delay(self, attempt: int, response: httpx.Response | None) -> float:
        if response is not None and "retry-after" in response.headers:
            try:
                return min(float(response.headers["retry-after"]), 60.0)
            except ValueError:
                pass
        return min(0.5 * 2 ** attempt, 20.0) * (0.5 + random.random() / 2)

    async def _request(self, method: str, path: str, body: dict | None = None) -> httpx.Response:
        started = time.monotonic()
        attempt = 0
        while True:
            response = None
            try:
                response = await self.http.request(method, path, json=body)
                if response.status_code < 400:
                    return response
                if response.status_code not in RETRYABLE:
                    raise LLMError(f"{self.base_url}{path} answered {response.status_code}: {_message(response)}")
                problem = f"{response.status_code}: {_message(response)}"
            except httpx.ConnectError as e:
                if time.monotonic() - started >= self.connect_wait:
                    raise self._unreachable(path, e) from None
                problem = f"{type(e).__name__}: {e}"
            except httpx.TransportError as e:
                problem = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
            delay = self._delay(attempt, response)
            waited = time.monotonic() - started
            if attempt >= self.max_retries and not (response is not None and response.status_code == 503) \
                    or waited + delay > self.max_wait:
                raise LLMError(f"{self.base_url}{path} failed after {attempt + 1} attempts over {waited:.0f} s "
                               f"(last: {problem}); is the LLM server running? (SCRIPTORIUM_LLM_URL)")
            attempt += 1
            await asyncio.sleep(delay)

    def _unreachable(self, path: str, error: httpx.ConnectError) -> "LLMError":
        return LLMError(f"cannot connect to the LLM server at {self.base_url} ({error or 'connection refused'}) while "
                        f"asking {path}: start it with `ops up`, or point SCRIPTORIUM_LLM_URL at a running one")

    async def models(self) -> list[str]:
        response = await self._request("GET", "/models")
        return [m["id"] for m in response.json().get("data", [])]

    async def resolve_model(self) -> str:
        if self.model is None:
            models = await self.models()
            if not models:
                raise LLMError(f"{self.base_url}/models lists no models")
            self.model = models[0]
        return self.model

    async def chat(self, messages: list[dict], *, max_tokens: int = 512, temperature: float = 0.7,
                   json_schema: dict | None = None, seed: int | None = None, stop: list[str] | None = None,
                   extra: dict | None = None) -> dict:
        """One chat completion: {"text", "finish_reason", "usage"}."""
        body = await self._chat_body(messages, max_tokens, temperature, json_schema, seed, stop, extra)
        data = (await self._request("POST", "/chat/completions", body)).json()
        try:
            choice = data["choices"][0]
            return {"text": choice["message"]["content"] or "", "finish_reason": choice.get("finish_reason"),
                    "usage": data.get("usage")}
        except (KeyError, IndexError, TypeError):
            raise LLMError(f"{self.base_url}/chat/completions answered something that is not a chat completion: "
                           f"{json.dumps(data)[:300]}") from None

    async def stream_chat(self, messages: list[dict], *, max_tokens: int = 512, temperature: float = 0.7,
                          seed: int | None = None, stop: list[str] | None = None) -> AsyncIterator[str]:
        """Text deltas as the server streams them (connection retries happen before the first byte only)."""
        body = await self._chat_body(messages, max_tokens, temperature, None, seed, stop, None)
        body["stream"] = True
        started = time.monotonic()
        attempt = 0
        while True:
            try:
                async with self.http.stream("POST", "/chat/completions", json=body) as response:
                    if response.status_code in RETRYABLE and time.monotonic() - started < self.max_wait:
                        await response.aread()
                        attempt += 1
                        await asyncio.sleep(self._delay(attempt, response))
                        continue
                    if response.status_code >= 400:
                        await response.aread()
                        raise LLMError(f"{self.base_url}/chat/completions answered {response.status_code}: "
                                       f"{_message(response)}")
                    async for line in response.aiter_lines():
                        if not line.startswith("data: ") or line == "data: [DONE]":
                            continue
                        chunk = json.loads(line[6:])
                        if "error" in chunk:
                            raise LLMError(f"stream failed: {chunk['error'].get('message')}")
                        for choice in chunk.get("choices", []):
                            delta = choice.get("delta", {}).get("content")
                            if delta:
                                yield delta
                    return
            except httpx.ConnectError as e:
                if time.monotonic() - started >= self.connect_wait:
                    raise self._unreachable("/chat/completions", e) from None
                attempt += 1
                await asyncio.sleep(min(self._delay(attempt, None), self.connect_wait))
            except httpx.TransportError as e:
                if attempt >= self.max_retries or time.monotonic() - started > self.max_wait:
                    raise LLMError(f"{self.base_url}/chat/completions: {type(e).__name__}: {e}") from None
                attempt += 1
                await asyncio.sleep(self._delay(attempt, None))

    async def _chat_body(self, messages, max_tokens, temperature, json_schema, seed, stop, extra) -> dict:
        body = {"model": await self.resolve_model(), "messages": messages, "max_tokens": max_tokens,
                "temperature": temperature}
        if json_schema is not None:
            body["response_format"] = {"type": "json_schema", "json_schema": {"name": "output", "schema": json_schema}}
        if seed is not None:
            body["seed"] = seed
        if stop:
            body["stop"] = stop
        body.update(extra or {})
        return body


def _message(response: httpx.Response) -> str:
    try:
        data = response.json()
        if isinstance(data, dict) and isinstance(data.get("error"), dict):
            return data["error"].get("message", "")
        return json.dumps(data)[:300]
    except ValueError:
        return response.text[:300]


class LLMRouter:
    """Several OpenAI-compatible upstreams as one: a request goes to an upstream serving its model
    (asked through /models) and fails over to the next when one is down."""

    def __init__(self, urls: list[str] | tuple[str, ...], model: str | None = None, api_key: str | None = None,
                 timeout: float = 600.0, max_wait: float = 600.0, connect_wait: float = 30.0):
        if not urls:
            raise LLMError("no LLM upstream configured; set SCRIPTORIUM_LLM_URL")
        # With more than one upstream, a dead one is skipped after a single retry instead of waited for.
        retries = 8 if len(urls) == 1 else 1
        self.clients = [LLMClient(u, None, api_key, timeout, max_wait, retries, connect_wait) for u in urls]
        self.model = model
        self._served: dict[str, list[str]] = {}

    @property
    def base_url(self) -> str:
        return ", ".join(c.base_url for c in self.clients)

    async def aclose(self) -> None:
        for client in self.clients:
            await client.aclose()

    async def __aenter__(self) -> "LLMRouter":
        return self

    async def __aexit__(self, *_) -> None:
        await self.aclose()

    async def upstreams(self) -> list[dict]:
        """Every upstream with its models, or the error that kept us from asking."""
        rows = []
        for client in self.clients:
            try:
                models = await asyncio.wait_for(client.models(), timeout=10)
                self._served[client.base_url] = models
                rows.append({"url": client.base_url, "healthy": True, "models": models, "error": None})
            except (TimeoutError, LLMError) as e:
                rows.append({"url": client.base_url, "healthy": False, "models": [], "error": str(e) or "timeout"})
        return rows

    def _unreachable(self, path: str, error: httpx.ConnectError) -> "LLMError":
        return LLMError(f"cannot connect to the LLM server at {self.base_url} ({error or 'connection refused'}) while "
                        f"asking {path}: start it with `ops up`, or point SCRIPTORIUM_LLM_URL at a running one")

    async def models(self) -> list[str]:
        seen = []
        for row in await self.upstreams():
            seen += [m for m in row["models"] if m not in seen]
        return seen

    async def _candidates(self, model: str | None) -> list[LLMClient]:
        if model is None:
            return self.clients
        if not any(model in served for served in self._served.values()):
            await self.upstreams()
        serving = [c for c in self.clients if model in self._served.get(c.base_url, [])]
        if not serving:
            known = sorted({m for served in self._served.values() for m in served})
            raise LLMError(f"no upstream serves model {model!r}; available: {', '.join(known) or 'none reachable'}")
        return serving

    async def chat(self, messages: list[dict], model: str | None = None, **kwargs) -> dict:
        model = model or self.model
        errors = []
        for client in await self._candidates(model):
            client.model = model
            try:
                return await client.chat(messages, **kwargs)
            except LLMError as e:
                if " answered 4" in str(e):  # the request itself is wrong: another upstream will not help
                    raise
                errors.append(str(e))
        raise LLMError("every LLM upstream failed: " + " | ".join(errors) +
                       "; start the backend with `ops up` or check SCRIPTORIUM_LLM_URL")

    async def stream_chat(self, messages: list[dict], model: str | None = None, **kwargs) -> AsyncIterator[str]:
        model = model or self.model
        errors = []
        for client in await self._candidates(model):
            client.model = model
            started = False
            try:
                async for delta in client.stream_chat(messages, **kwargs):
                    started = True
                    yield delta
                return
            except LLMError as e:
                if started or " answered 4" in str(e):
                    raise
                errors.append(str(e))
        raise LLMError("every LLM upstream failed: " + " | ".join(errors) +
                       "; start the backend with `ops up` or check SCRIPTORIUM_LLM_URL")
