"""POST /v1/completions: the legacy text completions API."""

from collections.abc import AsyncIterator

from fastapi import Request

from backend.server.errors import APIError
from backend.server.prompts import budget, check_guided, check_limits, completion_prompts
from backend.server.protocol import CompletionRequest, completion_choice, new_id, now, sampling_params, usage
from backend.server.state import ServerState
from backend.server.streams import collect, event, merge, sse, until_disconnect


async def create_completion(state: ServerState, req: CompletionRequest, request: Request):
    engine = state.ready_engine()
    if req.echo:
        raise APIError(400, "echo is not supported", param="echo")
    if req.suffix:
        raise APIError(400, "suffix is not supported", param="suffix")
    if req.best_of is not None and req.best_of != req.n:
        raise APIError(400, "best_of must equal n (candidates are not ranked)", param="best_of")
    if req.logprobs is not None and not 0 <= req.logprobs <= 20:
        raise APIError(400, f"logprobs must be in [0, 20], got {req.logprobs}", param="logprobs")
    several = isinstance(req.prompt, list) and bool(req.prompt) and not isinstance(req.prompt[0], int)
    count, limit = (len(req.prompt) if several else 1), engine.engine.config.max_prompts
    if count * req.n > limit:  # before any prompt is tokenized
        raise APIError(400, f"this request asks for {count * req.n} sequences ({count} prompts, n={req.n}); this "
                       f"server takes at most {limit} a request (serve --max-prompts): send them in several "
                       "requests", param="prompt")
    prompts = await completion_prompts(req.prompt, engine.engine)
    requested = 16 if req.max_tokens is None else req.max_tokens  # the legacy completions API's default
    params = [sampling_params(req, budget(engine.engine, len(p), requested, "max_tokens", "prompt"),
                              req.logprobs) for p in prompts]
    check_limits(engine.engine, params[0])
    await check_guided(engine.engine, params[0])
    rid = new_id("cmpl")
    # one request's prompts take their turns at admission together, so they cannot crowd out later requests
    gens = [engine.generate(f"{rid}-{i}", p, sp, group=rid) for i, (p, sp) in enumerate(zip(prompts, params))]
    if req.stream:
        return sse(_stream(state, rid, req, gens, prompts))
    finals = await until_disconnect(request, collect(gens, prompts, req.n))
    choices, completion_tokens = [], 0
    for i, out in enumerate(finals):
        for c in out.outputs:
            choices.append(completion_choice(i * req.n + c.index, c.text, c.token_ids, c.logprobs, req.logprobs,
                                             c.finish_reason))
            completion_tokens += len(c.token_ids)
    return {"id": rid, "object": "text_completion", "created": now(), "model": state.served_model_name,
            "choices": choices, "usage": usage(sum(len(p) for p in prompts), completion_tokens)}


def _stream(state: ServerState, rid: str, req: CompletionRequest, gens: list, prompts: list[list[int]]
            ) -> AsyncIterator[str]:
    created, include_usage = now(), bool(req.stream_options and req.stream_options.include_usage)

    def chunk(choices: list[dict], usage_value=None) -> str:
        body = {"id": rid, "object": "text_completion", "created": created, "model": state.served_model_name,
                "choices": choices}
        if include_usage:
            body["usage"] = usage_value
        return event(body)

    async def events():
        offsets = [[0] * req.n for _ in prompts]  # characters each choice has sent (logprobs' text_offset)
        prompt_tokens = completion_tokens = 0
        async for i, delta in merge(gens):
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
