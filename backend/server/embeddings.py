"""POST /v1/embeddings, and vLLM's /tokenize and /detokenize."""

import base64

import torch
from fastapi import Request
from pydantic import BaseModel

from backend.engine.admission import AdmittedEmbedding
from backend.sampling_params import InvalidParameter
from backend.server.chat import templated
from backend.server.errors import APIError
from backend.server.prompts import check_length, off_loop, token_lists
from backend.server.protocol import ChatMessage, ChatRequest, OpenAIBody, new_id
from backend.server.state import ServerState
from backend.server.streams import until_disconnect
from backend.server.tools.tool_defs import ToolDef

MAX_INPUTS = 2048  # as OpenAI's API


class EmbeddingRequest(OpenAIBody):  # user is ignored
    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: str = "float"
    dimensions: int | None = None


class TokenizeRequest(OpenAIBody):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None  # tokenized through the chat template
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: list[ToolDef] | None = None  # with messages: written into the prompt as chat completions write them
    chat_template_kwargs: dict | None = None  # with messages: the template's extra variables, as chat completions'


class DetokenizeRequest(BaseModel):
    model: str | None = None
    tokens: list[int]


def _token_ids(engine, value) -> AdmittedEmbedding:
    named = token_lists(engine, value, "input", MAX_INPUTS)
    try:  # each input's ids and length, and all the inputs together within max_embedding_tokens
        return engine.limits.check_embedding([ids for ids, _ in named])
    except InvalidParameter as e:
        raise APIError(400, str(e), param=e.param, code=e.code) from None


def _encode(vector: torch.Tensor, encoding: str) -> list[float] | str:
    if encoding == "base64":  # little-endian float32, as OpenAI's API (and its client's decoder)
        return base64.b64encode(vector.to(torch.float32).numpy().astype("<f4").tobytes()).decode()
    return vector.tolist()


async def create_embeddings(state: ServerState, req: EmbeddingRequest, request: Request):
    engine = state.ready_engine()
    if req.encoding_format not in ("float", "base64"):
        raise APIError(400, f"encoding_format must be float or base64, got {req.encoding_format!r}",
                       param="encoding_format")
    size = engine.engine.model_config.hidden_size
    if req.dimensions is not None and req.dimensions != size:
        raise APIError(400, f"dimensions: this model's embeddings have {size} dimensions and cannot be shortened",
                       param="dimensions")
    inputs = await off_loop(_token_ids, engine.engine, req.input)
    # scheduled beside the other requests, step by step; aborted (its KV blocks freed) if the client goes away
    vectors = await until_disconnect(request, engine.embed(new_id("embd"), inputs))
    tokens = sum(len(i) for i in inputs.inputs)
    return {"object": "list", "model": state.served_model_name,
            "data": [{"object": "embedding", "index": i, "embedding": _encode(v, req.encoding_format)}
                     for i, v in enumerate(vectors)],
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


def _tokenize(engine, prompt: str, add_special_tokens: bool) -> list[int]:
    check_length(engine, len(prompt), "prompt")
    return engine.tokenizer(prompt, add_special_tokens=add_special_tokens).input_ids


async def tokenize(state: ServerState, req: TokenizeRequest):
    """A prompt's token ids, or a conversation's (and its tools') exactly as chat completions would send it."""
    if (req.prompt is None) == (req.messages is None):
        raise APIError(400, "give prompt or messages (one of them)", param="prompt")
    if req.messages == []:
        raise APIError(400, "messages is empty", param="messages")
    async_engine = state.loaded_engine()
    engine = async_engine.engine
    if req.prompt is not None:
        ids = await off_loop(_tokenize, engine, req.prompt, req.add_special_tokens)
    else:
        chat = ChatRequest(model=req.model, messages=req.messages, tools=req.tools,
                           continue_final_message=req.continue_final_message,
                           chat_template_kwargs=req.chat_template_kwargs)
        _, ids = await templated(async_engine, chat, req.add_generation_prompt)
    return {"tokens": ids, "count": len(ids), "max_model_len": engine.max_model_len}


async def detokenize(state: ServerState, req: DetokenizeRequest):
    engine = state.loaded_engine().engine
    vocab = engine.model_config.vocab_size
    if any(t < 0 or t >= vocab for t in req.tokens):
        raise APIError(400, f"tokens must be in [0, {vocab})", param="tokens")
    return {"prompt": await off_loop(engine.tokenizer.decode, req.tokens)}


def _tokenizer_info(engine) -> dict:
    tok = engine.tokenizer
    if tok is None:
        raise APIError(404, f"model {engine.model_name!r} has no tokenizer: it takes token ids", type="not_found_error")
    info = {"tokenizer_class": type(tok).__name__, "vocab_size": engine.model_config.vocab_size,
            "model_max_length": engine.max_model_len, "chat_template": getattr(tok, "chat_template", None)}
    for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
        value = getattr(tok, name, None)
        info[name] = value if value is None or isinstance(value, str) else str(value)
        info[f"{name}_id"] = getattr(tok, f"{name}_id", None)
    info["add_bos_token"] = bool(getattr(tok, "add_bos_token", False))
    return info


async def tokenizer_info(state: ServerState) -> dict:
    """vLLM's GET /tokenizer_info: enough for a client (lm-evaluation-harness's remote tokenizer) to tokenize as
    the server does, through /tokenize and /detokenize."""
    return _tokenizer_info(state.loaded_engine().engine)
