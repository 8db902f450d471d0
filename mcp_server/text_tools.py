"""Text tools: generate_text, chat and list_models, over the LLM upstreams."""

import time
from typing import Annotated

from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from pydantic import Field

from mcp_server.models import Message, ModelEntry, ModelList, TextResult, Upstream
from mcp_server.tool_context import CREATES, READ_ONLY, state_of
from orchestrator.clients.llm_client import LLMError, StreamInfo


async def complete(ctx: Context, messages: list[dict], max_tokens: int, temperature: float,
                   model: str | None) -> TextResult:
    """Stream a chat completion until it ends or the budget runs out. A cancelled call closes the stream, so the
    LLM server aborts the request."""
    state = state_of(ctx)
    deadline = time.monotonic() + state.budget
    parts: list[str] = []
    truncated = False
    info = StreamInfo()
    stream = state.llm.stream_chat(messages, model=model, max_tokens=max_tokens, temperature=temperature, info=info)
    try:
        async for delta in stream:
            parts.append(delta)
            if len(parts) % 16 == 0:
                await ctx.report_progress(len(parts), max_tokens, f"{len(parts)} tokens")
            if time.monotonic() > deadline:
                truncated = True
                break
    except LLMError as e:
        raise ToolError(f"The LLM is unavailable: {e}") from None
    finally:
        await stream.aclose()
    # A stream cut at the budget (or an upstream that sends no usage) has no count of the server's: chunks, then.
    tokens = info.completion_tokens if info.completion_tokens is not None else len(parts)
    reason = "budget" if truncated else info.finish_reason
    return TextResult(text="".join(parts), model=info.model or model or state.llm.model, tokens=tokens,
                      truncated=reason in ("budget", "length"), finish_reason=reason)


def register(server: MCPServer) -> None:
    @server.tool(title="Generate text", annotations=CREATES)
    async def generate_text(
        prompt: Annotated[str, Field(min_length=1, description="what to write")],
        ctx: Context,
        system: Annotated[str | None, Field(description="optional system instructions")] = None,
        max_tokens: Annotated[int, Field(ge=1, le=8192)] = 512,
        temperature: Annotated[float, Field(ge=0, le=2)] = 0.7,
        model: Annotated[str | None, Field(description="a model from list_models; default: the first")] = None,
    ) -> TextResult:
        """Generate text with the local LLM. Returns the text; `truncated` is true when max_tokens or the time
        budget cut it (`finish_reason` says which: length, or budget; ask for fewer max_tokens after a budget)."""
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
        return await complete(ctx, messages, max_tokens, temperature, model)

    @server.tool(title="Chat", annotations=CREATES)
    async def chat(
        messages: Annotated[list[Message], Field(min_length=1, description="the conversation so far")],
        ctx: Context,
        max_tokens: Annotated[int, Field(ge=1, le=8192)] = 512,
        temperature: Annotated[float, Field(ge=0, le=2)] = 0.7,
        model: str | None = None,
    ) -> TextResult:
        """Continue a conversation (system/user/assistant messages) with the local LLM; returns the reply."""
        return await complete(ctx, [m.model_dump() for m in messages], max_tokens, temperature, model)

    @server.tool(title="List LLM models", annotations=READ_ONLY)
    async def list_models(ctx: Context) -> ModelList:
        """The models the LLM upstreams serve (SCRIPTORIUM_LLM_URL may list several)."""
        upstreams = await state_of(ctx).llm.upstreams()
        if not any(u["healthy"] for u in upstreams):
            raise ToolError("No LLM upstream answers: " + "; ".join(f"{u['url']}: {u['error']}" for u in upstreams))
        models = [ModelEntry(id=m, upstream=u["url"]) for u in upstreams for m in u["models"]]
        return ModelList(models=models, upstreams=[Upstream(**u) for u in upstreams])
