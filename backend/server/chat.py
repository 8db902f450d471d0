"""POST /v1/chat/completions: the chat template, sampling, and the answer as content and tool calls."""

from dataclasses import dataclass

from fastapi import Request

from backend.sampling_params import ApiFields
from backend.server import harmony
from backend.server.api_fields import OPENAI_CHAT, with_output_limit
from backend.server.async_engine import AsyncEngine
from backend.server.chat_stream import finish_reason, stream_chunks
from backend.server.client_id import client_id
from backend.server.errors import APIError
from backend.server.prompt_logprobs_shapes import prompt_logprobs_json
from backend.server.prompts import admit, budget, chat_prompt, check_guided, clamped_headers
from backend.server.protocol import (
    ChatRequest,
    chat_logprobs,
    chat_messages,
    new_id,
    now,
    sampling_params,
    usage,
)
from backend.server.reasoning import (
    ChoiceReader,
    effort_switches,
    new_reader,
    prompt_opens_thinking,
    reasoning_format,
    split_reasoning,
    think_marker_ids,
)
from backend.server.reasoning_count import reasoning_tokens
from backend.server.state import ServerState
from backend.server.streams import answer, collect, sse, until_disconnect
from backend.server.tools.conversation import check_history, template_input
from backend.server.tools.output import ToolCallStream, parse_message
from backend.server.tools.select import keeps_special_tokens, make_parser, parser_name
from backend.server.tools.tool_defs import ToolSpec, check_tools


@dataclass
class ChatTools:
    """How one request's output is read: for reasoning (backend/server/reasoning.py), then for tool calls."""

    spec: ToolSpec | None
    parser: str
    keep_special: bool
    tokenizer: object
    reasoning: str | None = None  # the reasoning format (None: the output is all answer)
    in_thinking: bool = False  # the prompt left a think block open: the output starts inside the reasoning

    def new_parser(self):
        return make_parser(self.spec, self.parser, self.tokenizer, self.keep_special)

    def new_reader(self) -> ChoiceReader:
        """A fresh reader of one choice's output as it is generated."""
        parser = self.new_parser()
        return ChoiceReader(new_reader(self.reasoning, self.in_thinking),
                            ToolCallStream(parser, self.parallel) if parser is not None else None)

    @property
    def parallel(self) -> bool:
        return self.spec is None or self.spec.parallel

    def reasoning_tokens(self, ids: list[int]) -> int:
        """How many of one choice's output tokens are its reasoning."""
        return reasoning_tokens(self.reasoning, self.in_thinking, self.tokenizer, ids)


def message(tools: ChatTools, text: str, reason: str | None) -> tuple[dict, str | None]:
    """One choice's whole text as an assistant message (its reasoning in reasoning_content and vLLM's newer
    reasoning, where the model's format has any), and its finish_reason."""
    reasoning, text = split_reasoning(tools.reasoning, text, tools.in_thinking)
    msg, reason = _calls(tools, text, reason)
    if tools.reasoning is not None:
        msg["reasoning_content"] = msg["reasoning"] = reasoning
    return msg, reason


def _calls(tools: ChatTools, text: str, reason: str | None) -> tuple[dict, str | None]:
    parser = tools.new_parser()
    if parser is None:
        return {"role": "assistant", "content": text}, reason
    content, calls = parse_message(parser, text, tools.parallel)
    if not calls:
        return {"role": "assistant", "content": content}, reason
    return ({"role": "assistant", "content": content or None, "tool_calls": [c.as_dict() for c in calls]},
            finish_reason(reason, True))


async def templated(engine: AsyncEngine, req: ChatRequest, add_generation_prompt: bool = True
                    ) -> tuple[ToolSpec | None, list[int]]:
    """The request's tools, checked, and its prompt's token ids through the chat template (/tokenize's too)."""
    spec = check_tools(req.tools, req.tool_choice, req.parallel_tool_calls, req.response_format)
    messages = chat_messages(req)
    check_history(messages)
    template = getattr(engine.engine.tokenizer, "chat_template", None)
    messages, template_tools = template_input(messages, spec, template)
    if reasoning_format(None, template) == "harmony":
        messages = harmony.template_messages(messages)
    return spec, await chat_prompt(engine.engine, messages, template_tools, req.continue_final_message,
                                   add_generation_prompt, template_variables(req))


TEMPLATE_OWN = ("messages", "conversation", "tools", "documents", "chat_template", "add_generation_prompt",
                "continue_final_message", "tokenize", "return_dict")


def template_variables(req: ChatRequest) -> dict:
    """The chat template's extra variables: vLLM's chat_template_kwargs (enable_thinking, ...), over what
    reasoning_effort switches."""
    given = req.chat_template_kwargs or {}
    taken = sorted(set(given) & set(TEMPLATE_OWN))
    if taken:
        raise APIError(400, f"chat_template_kwargs: {taken[0]!r} is the server's to set, not a template variable",
                       param="chat_template_kwargs")
    return {**effort_switches(req.reasoning_effort), **given}


async def prepare(state: ServerState, req: ChatRequest, api: ApiFields = OPENAI_CHAT):
    """The engine, the request as the engine admitted it (the prompt's token ids and the sampling settings), the
    tool reading of a chat request, and the headers its answer carries (a max_tokens clamped to the context).
    api: the API the request came in by (Messages and Responses translate theirs to a chat request), whose names
    and ranges the settings are checked with."""
    engine = state.ready_engine()
    if req.top_logprobs and not req.logprobs:
        raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
    spec, prompt = await templated(engine, req)
    tokenizer = engine.engine.tokenizer
    template = getattr(tokenizer, "chat_template", None)
    name = parser_name(state.policy.tool_call_parser, template, engine.engine.model_config.architecture)
    tools = ChatTools(spec, name, keeps_special_tokens(spec, name, tokenizer), tokenizer)
    requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    api = with_output_limit(api, "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens")
    which = api.name("max_tokens")
    clamp = state.policy.max_tokens_past_context == "clamp"
    allowed = budget(engine.engine, len(prompt), requested, which, "messages", clamp)
    guided = spec.guided_json() if spec is not None else None
    fmt = reasoning_format(state.policy.reasoning_parser, template)
    # harmony's markers are special tokens, which its reader reads
    params = sampling_params(req, allowed, (req.top_logprobs or 0) if req.logprobs else None, guided,
                             skip_special_tokens=not (tools.keep_special or fmt == "harmony"), api=api)
    think = think_marker_ids(tokenizer) if fmt == "think" else None
    if params.guided_json is None or think is not None:  # else the grammar holds from the first token: all answer
        tools.reasoning = fmt
        tools.in_thinking = fmt == "think" and prompt_opens_thinking(tokenizer, prompt)
    if params.guided_json is not None and think is not None:  # the grammar holds after the think block
        params.think_first = (*think, tools.in_thinking)
    admitted = await admit(engine.engine, prompt, params, "messages")
    await check_guided(engine.engine, params, "tools" if guided is not None else "response_format")
    return engine, admitted, tools, clamped_headers(requested, [allowed])


async def create_chat_completion(state: ServerState, req: ChatRequest, request: Request):
    engine, admitted, tools, headers = await prepare(state, req)
    prompt = admitted.token_ids
    rid = new_id("chatcmpl")
    gen = engine.generate(rid, admitted, client=client_id(request, req))
    if req.stream:
        chunks = stream_chunks(state.served_model_name, rid, req, gen, prompt, tools, state.policy.stream_keepalive)
        return answer(sse(chunks), headers)
    (out,) = await until_disconnect(request, collect([gen], [prompt], req.n))
    choices = []
    for c in out.outputs:
        msg, reason = message(tools, c.text, c.finish_reason)
        choices.append({"index": c.index, "message": msg, "finish_reason": reason,
                        "logprobs": chat_logprobs(c.logprobs, c.token_ids, req.top_logprobs or 0)
                        if req.logprobs else None})
    body = {"id": rid, "object": "chat.completion", "created": now(), "model": state.served_model_name,
            "choices": choices,
            "usage": usage(len(prompt), sum(len(c.token_ids) for c in out.outputs), out.num_cached_tokens,
                           sum(tools.reasoning_tokens(c.token_ids) for c in out.outputs))}
    if req.prompt_logprobs is not None:
        body["prompt_logprobs"] = prompt_logprobs_json(out.prompt_logprobs, prompt, req.prompt_logprobs)
    return answer(body, headers)
