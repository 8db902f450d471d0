"""An async client for any OpenAI-compatible server (ours, vLLM, SGLang, Ollama, llama.cpp, ...).

Retries on 429, 5xx, dropped connections and a 503 while the backend sleeps or loads, as
orchestrator/clients/retries.py decides; interactive callers (the MCP server) pass connect_wait=0 and hear at
once that the server is not running. A stream is retried only before its first text.
"""

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass

import httpx

from orchestrator.clients.retries import RETRYABLE, GiveUp, Retries


@dataclass
class StreamInfo:
    """What a chat stream says besides its text: the model that answered, and the completion's tokens as the
    server counted them (its usage, sent last when asked for with stream_options.include_usage)."""

    model: str | None = None
    completion_tokens: int | None = None
    finish_reason: str | None = None  # the first choice's: "length" when max_tokens cut it


class LLMError(Exception):
    pass


class StreamError(LLMError):
    """An error the server sent inside a stream (the HTTP status was already 200)."""

    def __init__(self, error: dict):
        super().__init__(f"stream failed: {error.get('message')}")
        code, kind = error.get("code"), str(error.get("type") or "").lower()
        # the server's own trouble (ours: service_unavailable, internal_error; vLLM: a code of 500 and up), not
        # the request's: another upstream may well answer it
        self.server_side = code >= 500 if isinstance(code, int) else \
            any(word in kind for word in ("internal", "server", "unavailable", "overloaded"))


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

    def _retries(self) -> Retries:
        return Retries(self.max_wait, self.max_retries, self.connect_wait)

    async def _send(self, method: str, path: str, body: dict | None, retries: Retries,
                    stream: bool = False) -> httpx.Response:
        """The first answer that is no retryable failure (when streaming, its body not read yet: close it);
        retried as orchestrator/clients/retries.py decides."""
        while True:
            try:
                response = await self.http.send(self.http.build_request(method, path, json=body), stream=stream)
            except httpx.ConnectError as e:
                try:
                    if await retries.after_refused(f"{type(e).__name__}: {e}"):
                        continue
                except GiveUp as gave_up:
                    raise self._gave_up(path, gave_up) from None
                raise self._unreachable(path, e) from None
            except httpx.TransportError as e:
                await self._after_failure(retries, path, f"{type(e).__name__}: {e}" if str(e) else type(e).__name__)
                continue
            if response.status_code < 400:
                return response
            try:
                await response.aread()
            except httpx.TransportError as e:  # the error's own body broke off: a failed transfer like any other
                await response.aclose()
                await self._after_failure(retries, path, f"{type(e).__name__}: {e}")
                continue
            if response.status_code not in RETRYABLE:
                raise LLMError(f"{self.base_url}{path} answered {response.status_code}: {_message(response)}")
            await self._after_failure(retries, path, f"{response.status_code}: {_message(response)}", response)

    async def _after_failure(self, retries: Retries, path: str, problem: str,
                             response: httpx.Response | None = None) -> None:
        try:
            await retries.after_failure(problem, response)
        except GiveUp as e:
            raise self._gave_up(path, e) from None

    def _gave_up(self, path: str, error: GiveUp) -> LLMError:
        return LLMError(f"{self.base_url}{path} {error}; is the LLM server running? (SCRIPTORIUM_LLM_URL)")

    async def _request(self, method: str, path: str, body: dict | None = None) -> httpx.Response:
        return await self._send(method, path, body, self._retries())

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
                   extra: dict | None = None, model: str | None = None) -> dict:
        """One chat completion: {"text", "finish_reason", "usage"}; model: this call's, else the client's."""
        body = await self._chat_body(model, messages, max_tokens, temperature, json_schema, seed, stop, extra)
        return chat_result(self.base_url, (await self._request("POST", "/chat/completions", body)).json())

    async def stream_chat(self, messages: list[dict], *, max_tokens: int = 512, temperature: float = 0.7,
                          seed: int | None = None, stop: list[str] | None = None,
                          info: StreamInfo | None = None, model: str | None = None) -> AsyncIterator[str]:
        """Text deltas as the server streams them (connection retries happen before the first byte only).
        info: filled with the answering model and the server's token count as they arrive."""
        body = await self._chat_body(model, messages, max_tokens, temperature, None, seed, stop, None)
        body.update(stream_body(info))
        retries = self._retries()
        while True:
            response = await self._send("POST", "/chat/completions", body, retries, stream=True)
            yielded = False
            try:
                async for line in response.aiter_lines():
                    deltas = stream_deltas(line, info)
                    if deltas is None:
                        return
                    for delta in deltas:
                        yielded = True
                        yield delta
                raise broken_stream(self.base_url, None)
            except httpx.TransportError as e:
                if yielded:  # never retried: the text so far would come twice
                    raise broken_stream(self.base_url, e) from None
                await self._after_failure(retries, "/chat/completions", f"{type(e).__name__}: {e}")
            finally:
                await response.aclose()

    async def _chat_body(self, model, messages, max_tokens, temperature, json_schema, seed, stop, extra) -> dict:
        return chat_body(model or await self.resolve_model(), messages, max_tokens, temperature, json_schema, seed,
                         stop, extra)


def chat_body(model: str, messages: list[dict], max_tokens: int = 512, temperature: float = 0.7,
              json_schema: dict | None = None, seed: int | None = None, stop: list[str] | None = None,
              extra: dict | None = None) -> dict:
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": temperature}
    if json_schema is not None:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "output", "schema": json_schema}}
    if seed is not None:
        body["seed"] = seed
    if stop:
        body["stop"] = stop
    body.update(extra or {})
    return body


def chat_result(url: str, data: dict) -> dict:
    """{"text", "finish_reason", "usage"} of a chat completion."""
    try:
        choice = data["choices"][0]
        return {"text": choice["message"]["content"] or "", "finish_reason": choice.get("finish_reason"),
                "usage": data.get("usage")}
    except (KeyError, IndexError, TypeError):
        raise LLMError(f"{url}/chat/completions answered something that is not a chat completion: "
                       f"{json.dumps(data)[:300]}") from None


def stream_body(info: StreamInfo | None) -> dict:
    """What a chat request adds to stream; the usage chunk only when someone reads it."""
    return {"stream": True, **({"stream_options": {"include_usage": True}} if info is not None else {})}


def stream_deltas(line: str, info: StreamInfo | None = None) -> list[str] | None:
    """The text deltas of one SSE line of a chat stream; None for the final `data: [DONE]`. info, when given,
    takes the chunk's model and usage."""
    if line == "data: [DONE]":
        return None
    if not line.startswith("data: "):
        return []
    chunk = json.loads(line[6:])
    if "error" in chunk:
        raise StreamError(chunk["error"] if isinstance(chunk["error"], dict) else {"message": chunk["error"]})
    if info is not None:
        info.model = chunk.get("model") or info.model
        usage = chunk.get("usage")
        if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
            info.completion_tokens = usage["completion_tokens"]
        for choice in chunk.get("choices", []):
            if isinstance(choice, dict) and choice.get("index", 0) == 0 and choice.get("finish_reason"):
                info.finish_reason = choice["finish_reason"]
    return [d for c in chunk.get("choices", []) if (d := c.get("delta", {}).get("content"))]


def broken_stream(url: str, error: Exception | None) -> LLMError:
    why = f"{type(error).__name__}: {error}" if error is not None else "it ended without data: [DONE]"
    return LLMError(f"the stream from {url}/chat/completions broke off before the answer was complete ({why}); "
                    "what arrived is only part of it: ask again")


def _message(response: httpx.Response) -> str:
    try:
        data = response.json()
        if isinstance(data, dict) and isinstance(data.get("error"), dict):
            return data["error"].get("message", "")
        return json.dumps(data)[:300]
    except ValueError:
        return response.text[:300]
