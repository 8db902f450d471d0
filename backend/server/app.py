"""The FastAPI application: a thin router over the APIs (each in its own module), health, metrics, sleep."""

import logging
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from backend.config import EngineConfig
from backend.engine.embedding import POOLING
from backend.server.auth import APIKey
from backend.server.chat import create_chat_completion
from backend.server.completions import create_completion
from backend.server.embeddings import (
    DetokenizeRequest,
    EmbeddingRequest,
    TokenizeRequest,
    create_embeddings,
    detokenize,
    tokenize,
    tokenizer_info,
)
from backend.server.errors import APIError, InternalErrors, error_body
from backend.server.limits import BodyLimit
from backend.server.messages import count_tokens, create_message
from backend.server.messages_shapes import CountTokensRequest, MessagesRequest
from backend.server.metrics import ServerMetrics
from backend.server.protocol import ChatRequest, CompletionRequest, now
from backend.server.registry import Budget, ModelRegistry
from backend.server.responses import ResponsesRequest, create_response
from backend.server.state import RETRY_AFTER, RequestPolicy, ServerState

log = logging.getLogger("backend.server")


MAX_BODY_BYTES = 4 << 20  # a 128k-token prompt is ~0.5 MB of text; more is a mistake or an attack


def build_app(config: EngineConfig, served_model_name: str | None = None,
              on_load_error: Callable[[str], None] | None = None, allow_sleep: bool = True,
              max_body_bytes: int = MAX_BODY_BYTES, policy: RequestPolicy | None = None,
              more_models: Sequence[tuple[str, EngineConfig]] = (), budget: Budget | None = None,
              api_key: str | None = None, model_aliases: Sequence[tuple[str, str]] = ()) -> FastAPI:
    """config is the default model's (loaded at start-up); more_models are (name, config) loaded on first use;
    model_aliases are (pattern, name): a request for a model no name matches takes the first pattern's."""
    registry: ModelRegistry | None = None
    metrics = ServerMetrics(lambda: {s.served_model_name: s.stats() for s in registry.states})
    states = [ServerState(c, name, policy, metrics)
              for name, c in [(served_model_name or config.model, config), *more_models]]
    registry = ModelRegistry(states, budget or Budget(), metrics, on_load_error, model_aliases)
    state = registry.default

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        registry.start()
        yield
        for s in registry.loaded():
            s.engine.stop()

    app = FastAPI(title="Scriptorium backend", lifespan=lifespan)
    app.state.server = state  # the default model's
    app.state.registry = registry
    app.add_middleware(InternalErrors)  # innermost of ours: what the routes raise unexpectedly
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes)
    if api_key:
        app.add_middleware(APIKey, key=api_key)

    def answer(request: Request, e: APIError) -> JSONResponse:
        return JSONResponse(error_body(request.url.path, e), status_code=e.status, headers=e.headers)

    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError):
        log.debug("answered %s %d: %s", request.url.path, e.status, e.message)  # why a client was refused
        return answer(request, e)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, e: RequestValidationError):
        first = e.errors()[0] if e.errors() else {"loc": (), "msg": "invalid request"}
        if first.get("type") == "json_invalid":
            message = f"the request body is not valid JSON ({first.get('ctx', {}).get('error', 'parse error')})"
            return answer(request, APIError(400, message))
        loc = [p for p in first.get("loc", ()) if p != "body"]
        param = "".join(f"[{p}]" if isinstance(p, int) else (f".{p}" if i else str(p)) for i, p in enumerate(loc))
        text = first["msg"].removeprefix("Value error, ")
        message = f"{param}: {text}" if param else text
        return answer(request, APIError(400, message, param=param or None))

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, e: HTTPException):
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return answer(request, APIError(e.status_code, str(e.detail), type=kind))

    @app.exception_handler(Exception)  # an exception in a middleware (the routes': InternalErrors)
    async def internal_error(request: Request, e: Exception):
        log.exception("internal error")
        return answer(request, APIError(500, f"internal error: {e}", type="internal_error"))

    @app.api_route("/", methods=["GET", "HEAD"])
    async def root():  # clients (Claude Code) probe the base URL before their first request
        return {"name": "Scriptorium backend", "apis": ["/v1/chat/completions", "/v1/completions", "/v1/responses",
                                                       "/v1/messages", "/v1/embeddings", "/v1/models"]}

    @app.get("/health")
    async def health():
        if state.load_error and not registry.ever_loaded:
            return JSONResponse({"status": "error", "error": state.load_error}, status_code=500)
        if not registry.ever_loaded:
            return JSONResponse({"status": "loading"}, status_code=503, headers=RETRY_AFTER)
        for s in registry.loaded():
            problem = s.engine.problem()
            if problem:
                return JSONResponse({"status": "error", "error": problem}, status_code=503)
        return {"status": "sleeping" if registry.sleep_level else "ok"}

    @app.get("/metrics")
    async def metrics():
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models():
        if not registry.ever_loaded:  # starting up: as /health, so routers and ops wait rather than send
            state.loaded_engine()  # 503 + Retry-After while the first model loads
        return {"object": "list", "data": [model_card(s) for s in registry.states]}

    @app.get("/v1/models/{name:path}")
    async def model(name: str):  # the SDKs' models.retrieve(); a 404 naming what is served otherwise
        if not registry.ever_loaded:
            state.loaded_engine()
        return model_card(registry.find(name))  # an alias (--model-alias): the card of the model it maps onto

    @app.post("/sleep")
    async def sleep(level: int = 1, timeout: float = 30.0):
        if not allow_sleep:
            raise APIError(409, "this server was started with --no-sleep: it keeps its GPU memory", type="conflict")
        if level not in (1, 2):
            raise APIError(400, f"level must be 1 (weights kept in CPU memory) or 2 (weights dropped), got {level}",
                           param="level")
        if not registry.ever_loaded:
            state.loaded_engine()  # 503 + Retry-After while the first model loads
        if not registry.sleep_level:
            registry.sleep_level = level  # no model loads from now on; /wake_up undoes a sleep that failed
            for s in registry.loaded():
                await sleep_model(s, level, timeout)
        return {"is_sleeping": True, "level": registry.sleep_level}

    @app.post("/wake_up")
    async def wake_up():
        if not registry.ever_loaded:
            state.loaded_engine()
        for s in registry.loaded():
            if s.sleep_level:
                await s.engine.call(lambda e: e.wake_up(), "wake_up")
                s.sleep_level = 0
        registry.sleep_level = 0
        return {"is_sleeping": False}

    @app.get("/is_sleeping")
    async def is_sleeping():
        return {"is_sleeping": bool(registry.sleep_level)}

    async def use(name: str | None, handler):
        """handler(state) on the named model, which is held until its answer (a stream too) is sent."""
        held = await registry.acquire(name)
        try:
            result = await handler(held)
        except BaseException:
            registry.release(held)
            raise
        if isinstance(result, StreamingResponse):
            result.body_iterator = released(result.body_iterator, lambda: registry.release(held))
        else:
            registry.release(held)
        return result

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        return await use(req.model, lambda s: create_completion(s, req, request))

    @app.post("/v1/chat/completions")
    async def chat(req: ChatRequest, request: Request):
        return await use(req.model, lambda s: create_chat_completion(s, req, request))

    @app.post("/v1/responses")
    async def responses(req: ResponsesRequest, request: Request):
        return await use(req.model, lambda s: create_response(s, req, request))

    @app.post("/v1/messages")
    async def messages(req: MessagesRequest, request: Request):
        return await use(req.model, lambda s: create_message(s, req, request))

    @app.post("/v1/messages/count_tokens")
    async def messages_count_tokens(req: CountTokensRequest):
        return await use(req.model, lambda s: count_tokens(s, req))

    @app.post("/v1/embeddings")
    async def embeddings(req: EmbeddingRequest, request: Request):
        return await use(req.model, lambda s: create_embeddings(s, req, request))

    @app.post("/tokenize")
    async def tokenize_route(req: TokenizeRequest):
        return await use(req.model, lambda s: tokenize(s, req))

    @app.get("/tokenizer_info")
    async def tokenizer_info_route(model: str | None = None):
        return await use(model, tokenizer_info)

    @app.post("/detokenize")
    async def detokenize_route(req: DetokenizeRequest):
        return await use(req.model, lambda s: detokenize(s, req))

    return app


def model_card(state: ServerState) -> dict:
    """One /v1/models entry: what a loaded model is, and whether it is loaded."""
    card = {"id": state.served_model_name, "object": "model", "created": now(), "owned_by": "scriptorium",
            "root": state.config.model,
            "status": "loading" if state.loading else "error" if state.load_error else
            "loaded" if state.engine is not None else "unloaded", "loads": state.loads}
    if state.load_error:
        card["error"] = state.load_error
    if state.engine is not None:
        engine = state.engine.engine
        card["max_model_len"] = engine.max_model_len
        card["memory_bytes"] = state.need  # weights and KV cache, as --models-memory counts them
        card["embedding"] = {**POOLING, "dimensions": engine.model_config.hidden_size}
    return card


async def sleep_model(state: ServerState, level: int, timeout: float) -> None:
    state.draining = True
    try:
        await state.engine.drain(timeout)
        await state.engine.call(lambda e: e.sleep(level), "sleep")
        state.sleep_level = level
    finally:
        state.draining = False


async def released(body: AsyncGenerator, release: Callable[[], None]) -> AsyncIterator:
    """body, then release(); closed at once when the client goes away, so the request is aborted now."""
    try:
        async for item in body:
            yield item
    finally:
        try:
            await body.aclose()
        finally:
            release()
