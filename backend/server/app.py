"""The FastAPI application: a thin router over the APIs (each in its own module), health, metrics, sleep."""

import logging
import threading
from collections.abc import Callable
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException

from backend.config import EngineConfig
from backend.engine.embedding import POOLING
from backend.engine.llm_engine import LLMEngine
from backend.server.async_engine import AsyncEngine
from backend.server.chat import create_chat_completion
from backend.server.completions import create_completion
from backend.server.embeddings import (
    DetokenizeRequest,
    EmbeddingRequest,
    TokenizeRequest,
    create_embeddings,
    detokenize,
    tokenize,
)
from backend.server.errors import APIError
from backend.server.limits import BodyLimit
from backend.server.protocol import ChatRequest, CompletionRequest, now
from backend.server.responses import ResponsesRequest, create_response
from backend.server.state import RETRY_AFTER, ServerState

log = logging.getLogger("backend.server")


MAX_BODY_BYTES = 4 << 20  # a 128k-token prompt is ~0.5 MB of text; more is a mistake or an attack


def build_app(config: EngineConfig, served_model_name: str | None = None,
              on_load_error: Callable[[str], None] | None = None, allow_sleep: bool = True,
              max_body_bytes: int = MAX_BODY_BYTES, tool_call_parser: str | None = None) -> FastAPI:
    state = ServerState(config, served_model_name or config.model, tool_call_parser)

    def load() -> None:
        try:
            state.engine = AsyncEngine(LLMEngine(config), state.metrics)
            log.info("model %s loaded; serving as %s", config.model, state.served_model_name)
        except Exception as e:  # reported by /health and by the CLI, which exits
            state.load_error = f"{type(e).__name__}: {e}" if not isinstance(e, ValueError) else str(e)
            log.error("could not load model %s: %s", config.model, state.load_error)
            if on_load_error:
                on_load_error(state.load_error)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        threading.Thread(target=load, name="model-load", daemon=True).start()
        yield
        if state.engine is not None:
            state.engine.stop()

    app = FastAPI(title="Scriptorium backend", lifespan=lifespan)
    app.state.server = state
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes)

    @app.exception_handler(APIError)
    async def api_error(_: Request, e: APIError):
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, e: RequestValidationError):
        first = e.errors()[0] if e.errors() else {"loc": (), "msg": "invalid request"}
        if first.get("type") == "json_invalid":
            message = f"the request body is not valid JSON ({first.get('ctx', {}).get('error', 'parse error')})"
            return JSONResponse(APIError(400, message).body(), status_code=400)
        loc = [p for p in first.get("loc", ()) if p != "body"]
        param = "".join(f"[{p}]" if isinstance(p, int) else (f".{p}" if i else str(p)) for i, p in enumerate(loc))
        message = f"{param}: {first['msg']}" if param else first["msg"]
        return JSONResponse(APIError(400, message, param=param or None).body(), status_code=400)

    @app.exception_handler(HTTPException)
    async def http_error(_: Request, e: HTTPException):
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return JSONResponse(APIError(e.status_code, str(e.detail), type=kind).body(), status_code=e.status_code)

    @app.exception_handler(Exception)
    async def internal_error(_: Request, e: Exception):
        log.exception("internal error")
        return JSONResponse(APIError(500, f"internal error: {e}", type="internal_error").body(), status_code=500)

    @app.get("/health")
    async def health():
        if state.load_error:
            return JSONResponse({"status": "error", "error": state.load_error}, status_code=500)
        if state.engine is None:
            return JSONResponse({"status": "loading"}, status_code=503, headers=RETRY_AFTER)
        problem = state.engine.problem()
        if problem:
            return JSONResponse({"status": "error", "error": problem}, status_code=503)
        return {"status": "sleeping" if state.sleep_level else "ok"}

    @app.get("/metrics")
    async def metrics():
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models():
        engine = state.loaded_engine()
        return {"object": "list", "data": [{
            "id": state.served_model_name, "object": "model", "created": now(), "owned_by": "scriptorium",
            "root": config.model, "max_model_len": engine.engine.max_model_len,
            "embedding": {**POOLING, "dimensions": engine.engine.model_config.hidden_size},
        }]}

    @app.post("/sleep")
    async def sleep(level: int = 1, timeout: float = 30.0):
        if not allow_sleep:
            raise APIError(409, "this server was started with --no-sleep: it keeps its GPU memory", type="conflict")
        if level not in (1, 2):
            raise APIError(400, f"level must be 1 (weights kept in CPU memory) or 2 (weights dropped), got {level}",
                           param="level")
        engine = state.loaded_engine()
        if not state.sleep_level:
            state.draining = True
            try:
                await engine.drain(timeout)
                await engine.call(lambda e: e.sleep(level))
                state.sleep_level = level
            finally:
                state.draining = False
        return {"is_sleeping": True, "level": state.sleep_level}

    @app.post("/wake_up")
    async def wake_up():
        engine = state.loaded_engine()
        if state.sleep_level:
            await engine.call(lambda e: e.wake_up())
            state.sleep_level = 0
        return {"is_sleeping": False}

    @app.get("/is_sleeping")
    async def is_sleeping():
        return {"is_sleeping": bool(state.sleep_level)}

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        return await create_completion(state, req, request)

    @app.post("/v1/chat/completions")
    async def chat(req: ChatRequest, request: Request):
        return await create_chat_completion(state, req, request)

    @app.post("/v1/responses")
    async def responses(req: ResponsesRequest, request: Request):
        return await create_response(state, req, request)

    @app.post("/v1/embeddings")
    async def embeddings(req: EmbeddingRequest):
        return await create_embeddings(state, req)

    @app.post("/tokenize")
    async def tokenize_route(req: TokenizeRequest):
        return await tokenize(state, req)

    @app.post("/detokenize")
    async def detokenize_route(req: DetokenizeRequest):
        return await detokenize(state, req)

    return app
