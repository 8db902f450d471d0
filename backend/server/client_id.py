"""Who sent a request, as admission's turns and slot shares count clients (engine/wait_queue.py).

The user the body names wins: OpenAI's `user`, `safety_identifier` or `prompt_cache_key` (Codex sends its
conversation's), Anthropic's `metadata.user_id` (Claude Code sends its session's). Else the caller's user agent
and address: on one machine that tells the agents apart (Claude Code from Codex from the orchestrator). A
client that names a new user for every request gets what a request got before clients had turns: its own.
"""

from fastapi import Request

NAMED_FIELDS = ("user", "safety_identifier", "prompt_cache_key")  # OpenAI's, in the order they are taken


def client_id(request: Request, body: object) -> str:
    """The client key of a request whose parsed body is `body` (a pydantic model of any of the APIs)."""
    extra = getattr(body, "model_extra", None) or {}
    named = [getattr(body, f, None) or extra.get(f) for f in NAMED_FIELDS]
    metadata = getattr(body, "metadata", None)
    if isinstance(metadata, dict):
        named.append(metadata.get("user_id"))
    user = next((n for n in named if isinstance(n, str) and n), None)
    if user is not None:
        return f"user:{user}"
    host = request.client.host if request.client else "unknown"
    return f"agent:{request.headers.get('user-agent', '')}@{host}"
