"""The FastAPI application: OpenAI's completion and chat routes, health, metrics, sleep and wake."""

import asyncio
import json
import logging
import threading
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from backend.config import EngineConfig
from backend.engine.llm_engine import LLMEngine
from backend.engine.output import OutputAssembler, RequestDelta
from backend.outputs import RequestOutput
from backend.server.async_engine import AsyncEngine
from backend.server.limits import BodyLimit
from backend.server.metrics import ServerMetrics
from backend.server.prompts import budget, chat_prompt, check_guided, check_limits, completion_prompts
from backend.server.protocol import (
    APIError,
    ChatRequest,
    CompletionRequest,
    chat_logprobs,
    chat_messages,
    completion_choice,
    new_id,
    now,
    sampling_params,
    usage,
)

log = logging.getLogger("backend.server")
RETRY_AFTER = {"Retry-After": "5"}


class ServerState:
    def __init__(self, config: EngineConfig, served_model_name: str):
        self.config = config
        self.served_model_name = served_model_name
        self.engine: AsyncEngine | None = None
        self.load_error: str | None = None
        self.sleep_level = 0
        self.draining = False
        self.metrics = ServerMetrics(self.stats)

    def stats(self) -> dict:
        if self.engine is None:
            return {"running": 0, "waiting": 0, "kv_cache_usage": 0.0, "num_free_blocks": 0,
                    "prefix_cache_queries": 0, "prefix_cache_hits": 0, "num_preemptions": 0, "sleeping": 0,
                    "spec_draft_tokens": 0, "spec_accepted_tokens": 0, "spec_verifications": 0}
        return self.engine.engine.stats()

    def loaded_engine(self) -> AsyncEngine:
        """The engine once loaded, asleep or not; 503 + Retry-After while loading."""
        if self.engine is None:
            raise APIError(503, "the model is still loading; retry shortly", type="service_unavailable",
                           headers=RETRY_AFTER)
        return self.engine

    def ready_engine(self) -> AsyncEngine:
        """The engine when it can take requests: loaded and awake."""
        self.loaded_engine()
        if self.sleep_level or self.draining:
            raise APIError(503, "the model is asleep while its memory is lent to another service; retry shortly",
                           type="service_unavailable", headers=RETRY_AFTER)
        return self.engine

    def check_model(self, name: str | None) -> None:
        if name is not None and name not in (self.served_model_name, self.config.model):
            raise APIError(404, f"The model `{name}` does not exist; this server serves `{self.served_model_name}`.",
                           param="model", code="model_not_found")


MAX_BODY_BYTES = 4 << 20  # a 128k-token prompt is ~0.5 MB of text; more is a mistake or an attack


def build_app(config: EngineConfig, served_model_name: str | None = None,
              on_load_error: Callable[[str], None] | None = None, allow_sleep: bool = True,
              max_body_bytes: int = MAX_BODY_BYTES) -> FastAPI:
    state = ServerState(config, served_model_name or config.model)

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
        state.check_model(req.model)
        engine = state.ready_engine()
        if req.echo:
            raise APIError(400, "echo is not supported", param="echo")
        if req.suffix:
            raise APIError(400, "suffix is not supported", param="suffix")
        if req.best_of is not None and req.best_of != req.n:
            raise APIError(400, "best_of must equal n (candidates are not ranked)", param="best_of")
        if req.logprobs is not None and not 0 <= req.logprobs <= 20:
            raise APIError(400, f"logprobs must be in [0, 20], got {req.logprobs}", param="logprobs")
        prompts = await completion_prompts(req.prompt, engine.engine)
        requested = 16 if req.max_tokens is None else req.max_tokens  # the legacy completions API's default
        params = [sampling_params(req, budget(engine.engine, len(p), requested, "max_tokens", "prompt"),
                                  req.logprobs) for p in prompts]
        check_limits(engine.engine, params[0])
        await check_guided(engine.engine, params[0])
        rid = new_id("cmpl")
        gens = [engine.generate(f"{rid}-{i}", p, sp) for i, (p, sp) in enumerate(zip(prompts, params))]
        if req.stream:
            return _sse(_stream_completion(rid, req, gens, prompts))
        finals = await _until_disconnect(request, _collect(gens, prompts, req.n))
        choices, completion_tokens = [], 0
        for i, out in enumerate(finals):
            for c in out.outputs:
                choices.append(completion_choice(i * req.n + c.index, c.text, c.token_ids, c.logprobs, req.logprobs,
                                                 c.finish_reason))
                completion_tokens += len(c.token_ids)
        return {"id": rid, "object": "text_completion", "created": now(), "model": state.served_model_name,
                "choices": choices, "usage": usage(sum(len(p) for p in prompts), completion_tokens)}

    @app.post("/v1/chat/completions")
    async def chat(req: ChatRequest, request: Request):
        state.check_model(req.model)
        engine = state.ready_engine()
        if req.top_logprobs is not None and not 0 <= req.top_logprobs <= 20:
            raise APIError(400, f"top_logprobs must be in [0, 20], got {req.top_logprobs}", param="top_logprobs")
        if req.top_logprobs and not req.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        prompt = await chat_prompt(engine.engine, chat_messages(req))
        requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        name = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        allowed = budget(engine.engine, len(prompt), requested, name, "messages")
        params = sampling_params(req, allowed, (req.top_logprobs or 0) if req.logprobs else None)
        check_limits(engine.engine, params)
        await check_guided(engine.engine, params)
        rid = new_id("chatcmpl")
        gen = engine.generate(rid, prompt, params)
        if req.stream:
            return _sse(_stream_chat(rid, req, gen, len(prompt)))
        (out,) = await _until_disconnect(request, _collect([gen], [prompt], req.n))
        choices = [{
            "index": c.index, "message": {"role": "assistant", "content": c.text},
            "logprobs": chat_logprobs(c.logprobs, c.token_ids, req.top_logprobs or 0) if req.logprobs else None,
            "finish_reason": c.finish_reason,
        } for c in out.outputs]
        return {"id": rid, "object": "chat.completion", "created": now(), "model": state.served_model_name,
                "choices": choices, "usage": usage(len(prompt), sum(len(c.token_ids) for c in out.outputs))}

    def _stream_chat(rid, req, gen, prompt_len) -> AsyncIterator[str]:
        created, include_usage = now(), bool(req.stream_options and req.stream_options.include_usage)

        def chunk(choices: list[dict], usage_value=None) -> str:
            body = {"id": rid, "object": "chat.completion.chunk", "created": created,
                    "model": state.served_model_name, "choices": choices}
            if include_usage:
                body["usage"] = usage_value
            return _event(body)

        async def events():
            for i in range(req.n):
                yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                              "finish_reason": None}])
            completion_tokens = 0
            async for delta in gen:
                for d in delta.outputs:
                    completion_tokens += len(d.token_ids)
                    lp = None
                    if req.logprobs and d.logprobs and d.token_ids:
                        lp = chat_logprobs(d.logprobs, d.token_ids, req.top_logprobs or 0)
                    if d.text or lp:
                        yield chunk([{"index": d.index, "delta": {"content": d.text}, "logprobs": lp,
                                      "finish_reason": None}])
                    if d.finished:
                        yield chunk([{"index": d.index, "delta": {}, "logprobs": None,
                                      "finish_reason": d.finish_reason}])
            if include_usage:
                yield chunk([], usage(prompt_len, completion_tokens))

        return events()

    def _stream_completion(rid, req, gens, prompts) -> AsyncIterator[str]:
        created, include_usage = now(), bool(req.stream_options and req.stream_options.include_usage)

        def chunk(choices: list[dict], usage_value=None) -> str:
            body = {"id": rid, "object": "text_completion", "created": created, "model": state.served_model_name,
                    "choices": choices}
            if include_usage:
                body["usage"] = usage_value
            return _event(body)

        async def events():
            offsets = [[0] * req.n for _ in prompts]  # characters each choice has sent (logprobs' text_offset)
            prompt_tokens = completion_tokens = 0
            async for i, delta in _merge(gens):
                for d in delta.outputs:
                    completion_tokens += len(d.token_ids)
                    if d.text or d.finished or (req.logprobs is not None and d.token_ids):
                        yield chunk([completion_choice(i * req.n + d.index, d.text, d.token_ids, d.logprobs,
                                                       req.logprobs, d.finish_reason, offsets[i][d.index])])
                    offsets[i][d.index] += len(d.text)
                if delta.finished:
                    prompt_tokens += len(prompts[i])
            if include_usage:
                yield chunk([], usage(prompt_tokens, completion_tokens))

        return events()

    return app


def _event(body: dict) -> str:
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"


def _sse(events: AsyncIterator[str]) -> StreamingResponse:
    async def body():
        try:
            async for event in events:
                yield event
        except APIError as e:
            yield _event(e.body())
        except Exception as e:  # noqa: BLE001 the stream has started: report in-band, not as a 500
            log.exception("stream failed")
            yield _event(APIError(500, f"internal error: {e}", type="internal_error").body())
        yield "data: [DONE]\n\n"

    return StreamingResponse(body(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


async def _merge(gens: list) -> AsyncIterator[tuple[int, RequestDelta]]:
    """Interleave several requests' output streams, tagged with their position."""
    if len(gens) == 1:
        async for out in gens[0]:
            yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i, gen):
        try:
            async for out in gen:
                await queue.put((i, out))
        except BaseException as e:  # noqa: BLE001 handed to the consumer
            await queue.put((i, e))
        finally:
            await queue.put((i, done))

    tasks = [asyncio.create_task(pump(i, g)) for i, g in enumerate(gens)]
    remaining = len(gens)
    try:
        while remaining:
            i, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()


async def _collect(gens: list, prompts: list[list[int]], n: int) -> list[RequestOutput]:
    """Each request's whole output, assembled from its deltas."""
    assemblers = [OutputAssembler("", None, prompt, n) for prompt in prompts]
    async for i, delta in _merge(gens):
        assemblers[i].add(delta)
    return [a.output() for a in assemblers]


async def _until_disconnect(request: Request, coro):
    """Await coro, cancelling it (which aborts its requests) if the client goes away meanwhile."""
    task = asyncio.ensure_future(coro)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=0.5)
            if done:
                return task.result()
            if await request.is_disconnected():
                task.cancel()
                raise APIError(499, "client disconnected", type="client_closed_request")
    finally:
        if not task.done():
            task.cancel()
