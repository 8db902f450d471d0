"""The Responses API's objects: a response, its output items, its usage (as the openai client's types say)."""

import uuid

from backend.server.protocol import OpenAIBody


class ResponsesRequest(OpenAIBody):  # metadata, user, include, truncation, ... are ignored

    model: str | None = None
    input: str | list[dict]
    instructions: str | None = None
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    store: bool | None = None
    previous_response_id: str | None = None
    text: dict | None = None  # {"format": {"type": "text" | "json_object" | "json_schema", "schema": ...}}
    seed: int | None = None
    reasoning: dict | None = None  # {"effort": ...}: none/minimal turn the template's thinking switch off


def new_item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def message_item(item_id: str, text: str, status: str) -> dict:
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


def reasoning_item(item_id: str, text: str, status: str) -> dict:
    """The model's reasoning as its text (reasoning_text), with no summary: nothing here summarizes it."""
    return {"type": "reasoning", "id": item_id, "status": status, "summary": [],
            "content": [{"type": "reasoning_text", "text": text}]}


def response_body(req: ResponsesRequest, rid: str, model: str, created: float, status: str, output: list[dict],
                  usage: dict | None) -> dict:
    return {
        "id": rid, "object": "response", "created_at": created, "status": status, "model": model,
        "output": output, "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
        "parallel_tool_calls": True if req.parallel_tool_calls is None else req.parallel_tool_calls,
        "temperature": req.temperature, "top_p": req.top_p, "tool_choice": req.tool_choice or "auto",
        "tools": req.tools or [], "text": req.text or {"format": {"type": "text"}}, "store": False,
        "previous_response_id": None, "truncation": "disabled", "metadata": getattr(req, "metadata", None) or {},
        "usage": usage,
    }


def response_usage(prompt_tokens: int, output_tokens: int, cached: int = 0, reasoning: int = 0) -> dict:
    return {"input_tokens": prompt_tokens,
            "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
            "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": reasoning},
            "total_tokens": prompt_tokens + output_tokens}
