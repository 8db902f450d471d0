"""Fitting a request's completion budget to the model's context: a server started with --max-model-len 2048 refuses
a prompt plus max_tokens past 2,048 tokens (ours and vLLM with a 400), so the pipelines ask for what fits.

The context comes from the upstreams' /v1/models (`max_model_len`, which ours and vLLM list per model; the smallest
when several upstreams serve the model); the prompt's length from the server's POST /tokenize (ours and vLLM take
the chat messages), else from an estimate. A server that lists no context leaves the budget as asked.
"""

import asyncio

import httpx

from common.backend_client import root
from orchestrator.clients.llm_client import LLMError
from orchestrator.clients.router import LLMRouter
from orchestrator.clients.upstream import Upstream

MIN_ANSWER = 16  # tokens: less room than this for the answer is an error, not a uselessly short answer
TEMPLATE_TOKENS = 32  # per message: a generous bound on what a chat template adds around each one
CHARS_PER_TOKEN = 3  # the estimate without /tokenize: English runs near 4 characters a token in BPE vocabularies


async def _cards(up: Upstream) -> list[dict]:
    try:
        response = await up.client.http.get("/models", timeout=10)
        response.raise_for_status()
        data = response.json().get("data")
        return [c for c in data if isinstance(c, dict)] if isinstance(data, list) else []
    except (httpx.HTTPError, ValueError, AttributeError):
        return []


async def context_window(router: LLMRouter, model: str | None = None) -> int | None:
    """The model's max_model_len as its upstreams list it (the smallest of them), None when none says; asked once
    per router and model."""
    key = model or router.model or ""
    if key not in router.windows:
        listed = await asyncio.gather(*(_cards(u) for u in router.pool))
        name = key or next((cards[0].get("id") for cards in listed if cards), None)  # the router's default
        lengths = []
        for cards in listed:
            length = next((c.get("max_model_len") for c in cards if c.get("id") == name), None)
            if isinstance(length, int) and not isinstance(length, bool) and length > 0:
                lengths.append(length)
        router.windows[key] = min(lengths) if lengths else None
    return router.windows[key]


def _text(messages: list[dict]) -> str:
    return "".join(str(m.get("content") or "") for m in messages)


def upper_bound(messages: list[dict]) -> int:
    """At most this many tokens: byte-level vocabularies spend at least one byte per token."""
    return len(_text(messages).encode()) + TEMPLATE_TOKENS * (len(messages) + 1)


async def prompt_tokens(router: LLMRouter, messages: list[dict], model: str | None = None) -> int:
    """The chat prompt's length in tokens as the first upstream counts it, or an estimate where it cannot."""
    name = model or router.model
    body = {"messages": messages, **({"model": name} if name else {})}
    try:
        up = router.pool[0]
        response = await up.client.http.post(f"{root(up.url)}/tokenize", json=body, timeout=30)
        count = response.json().get("count") if response.status_code == 200 else None
        if isinstance(count, int):
            return count
    except (httpx.HTTPError, ValueError, AttributeError):
        pass
    return len(_text(messages)) // CHARS_PER_TOKEN + TEMPLATE_TOKENS * (len(messages) + 1)


async def fit(router: LLMRouter, messages: list[dict], wanted: int, model: str | None = None) -> int:
    """max_tokens for this request: `wanted`, or what the model's context leaves beside the prompt."""
    window = await context_window(router, model)
    if window is None or upper_bound(messages) + wanted <= window:
        return wanted  # fits whatever the tokenizer: no need to ask
    used = await prompt_tokens(router, messages, model)
    room = window - used
    if room < MIN_ANSWER:
        raise LLMError(f"the prompt takes {used} of the model's {window} tokens of context (its max_model_len), "
                       f"leaving no room for an answer; serve it with a longer --max-model-len or shorten the sources")
    return min(wanted, room)
