"""Reasoning apart from the answer on every API, against the real server, through the official SDKs.

A tiny random model whose chat template opens a think block in the generation prompt (as DeepSeek-R1's does;
`enable_thinking: false` writes an empty block instead, as Qwen3's does) and whose tokenizer has `<think>` and
`</think>` as tokens. What the model writes is known from /v1/completions on the same prompt ids; the
reasoning and the answer must be that text cut at its first `</think>`.
"""

import json

import anthropic
import httpx
import openai
import pytest
from transformers import AutoTokenizer

from tests.backend.server_process import ServerProcess
from tests.backend.tiny_models import build_model

THINK_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.role == 'assistant' and m.reasoning_content %}<think>\n{{ m.reasoning_content }}\n</think>\n\n"
    "{% endif %}{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% if enable_thinking is defined and not enable_thinking %}"
    "<think>\n\n</think>\n\n{% else %}<think>\n{% endif %}{% endif %}"
)
ASK = [{"role": "user", "content": "hi"}]
OFF = {"enable_thinking": False}
WIRE_EVENTS = (
    "message_start",
    "content_block_start",
    "content_block_delta",
    "content_block_stop",
    "message_delta",
    "message_stop",
)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = build_model(
        "qwen3", tmp_path_factory.mktemp("think") / "tiny-think", chat_template=THINK_TEMPLATE
    )
    tokenizer = AutoTokenizer.from_pretrained(str(model))
    tokenizer.add_tokens(["<think>", "</think>"])  # as Qwen3's: added tokens, not special ones
    tokenizer.save_pretrained(str(model))
    proc = ServerProcess(str(model), "--served-model-name", "tiny", "--max-model-len", "512")
    proc.model = str(model)
    proc.ids = {t: tokenizer.encode(t, add_special_tokens=False)[0] for t in (" b", "</think>")}
    yield proc
    assert proc.stop() == 0


def written(
    server, messages: list[dict], max_tokens: int, kwargs: dict | None = None, **sampling
) -> tuple[int, str]:
    """The prompt's length and the text the model writes after it, read raw from /v1/completions."""
    ids = httpx.post(
        f"{server.url}/tokenize", json={"model": "tiny", "messages": messages, "chat_template_kwargs": kwargs}
    ).json()["tokens"]
    out = httpx.post(
        f"{server.url}/v1/completions",
        json={"model": "tiny", "prompt": ids, "temperature": 0, "max_tokens": max_tokens, **sampling},
        timeout=60,
    ).json()
    return len(ids), out["choices"][0]["text"]


def written_tokens(server, messages: list[dict], max_tokens: int, **sampling) -> list[str]:
    """The tokens the model writes after the messages' prompt, as /v1/completions' logprobs name them."""
    ids = httpx.post(f"{server.url}/tokenize", json={"model": "tiny", "messages": messages}).json()["tokens"]
    out = httpx.post(
        f"{server.url}/v1/completions",
        json={"model": "tiny", "prompt": ids, "temperature": 0, "max_tokens": max_tokens, "logprobs": 0,
              **sampling},
        timeout=60,
    ).json()
    return out["choices"][0]["logprobs"]["tokens"]


def cut(text: str) -> tuple[str | None, str]:
    reasoning, closed, answer = text.partition("</think>")
    return reasoning.strip() or None, answer.lstrip() if closed else ""


def test_chat_completions_reasoning_content_streamed_and_not(server):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    b, close = server.ids[" b"], server.ids["</think>"]
    for allowed, max_tokens in (([b], 3), ([b, close], 10)):
        _, raw = written(server, ASK, max_tokens, allowed_token_ids=allowed)
        reasoning, answer = cut(raw)
        kwargs = dict(
            model="tiny",
            messages=ASK,
            temperature=0,
            max_tokens=max_tokens,
            extra_body={"allowed_token_ids": allowed},
        )
        out = client.chat.completions.create(**kwargs)
        msg = out.choices[0].message
        assert (msg.reasoning_content, msg.content) == (reasoning, answer)
        # the prompt opened the block: the tokens through the first </think> (all, while it is open) are reasoning
        tokens = written_tokens(server, ASK, max_tokens, allowed_token_ids=allowed)
        thought = tokens.index("</think>") + 1 if "</think>" in tokens else len(tokens)
        assert out.usage.completion_tokens_details.reasoning_tokens == thought
        assert msg.model_extra["reasoning"] == reasoning  # vLLM's newer name
        chunks = [
            c.choices[0].delta for c in client.chat.completions.create(stream=True, **kwargs) if c.choices
        ]
        assert "".join(d.model_extra.get("reasoning_content") or "" for d in chunks) == (reasoning or "")
        assert "".join(d.content or "" for d in chunks) == answer
    assert reasoning is None and "</think>" in raw and answer  # the block closed at once; the answer after it

    # enable_thinking false renders the template's empty block: no reasoning, the text is all answer
    length, raw = written(server, ASK, 3, OFF, allowed_token_ids=[b])
    for extra in ({"chat_template_kwargs": OFF}, {"reasoning_effort": "none"}):
        out = client.chat.completions.create(
            model="tiny",
            messages=ASK,
            temperature=0,
            max_tokens=3,
            extra_body={"allowed_token_ids": [b], **extra},
        )
        assert (out.choices[0].message.reasoning_content, out.choices[0].message.content) == (None, raw)
        # the empty block is in the prompt
        assert out.usage.prompt_tokens == length > written(server, ASK, 1)[0]


def test_messages_thinking_blocks_streamed_and_not(server):
    client = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)
    _, raw = written(server, ASK, 6)
    assert "</think>" not in raw  # the model is still thinking when max_tokens stops it
    kwargs = dict(model="tiny", messages=ASK, max_tokens=6, extra_body={"temperature": 0})
    out = client.messages.create(**kwargs)
    assert [b.model_dump() for b in out.content] == [
        {"type": "thinking", "thinking": raw.strip(), "signature": ""}
    ]
    with client.messages.stream(**kwargs) as stream:
        # the SDK adds events of its own (text, thinking, signature): the wire's alone
        events = [
            (e.type, getattr(getattr(e, "delta", None), "type", None))
            for e in stream
            if e.type in WIRE_EVENTS
        ]
        final = stream.get_final_message()
    assert final.content == out.content
    assert events[1] == ("content_block_start", None) and ("content_block_delta", "thinking_delta") in events
    assert (
        events.index(("content_block_delta", "signature_delta"))
        == events.index(("content_block_stop", None)) - 1
    )

    _, raw_off = written(server, ASK, 6, OFF)
    off = client.messages.create(**kwargs, thinking={"type": "disabled"})
    assert [b.model_dump(exclude_none=True) for b in off.content] == [{"type": "text", "text": raw_off}]
    # thinking sent back is rendered as the template expects: the same prompt as the history in chat's field
    history = [
        *ASK,
        {
            "role": "assistant",
            "content": [
                {"type": "thinking", "thinking": "hmm", "signature": ""},
                {"type": "text", "text": "hello"},
            ],
        },
        {"role": "user", "content": "bye"},
    ]
    counted = client.messages.count_tokens(model="tiny", messages=history).input_tokens
    chat_history = [
        *ASK,
        {"role": "assistant", "content": "hello", "reasoning_content": "hmm"},
        {"role": "user", "content": "bye"},
    ]
    without = [*ASK, {"role": "assistant", "content": "hello"}, {"role": "user", "content": "bye"}]
    assert counted == written(server, chat_history, 1)[0] > written(server, without, 1)[0]


def test_responses_reasoning_item_streamed_and_not(server):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    _, raw = written(server, ASK, 6)
    kwargs = dict(model="tiny", input="hi", max_output_tokens=6, temperature=0)
    out = client.responses.create(**kwargs)
    (item,) = out.output
    assert item.type == "reasoning" and item.summary == [] and item.status == "incomplete"
    assert [(c.type, c.text) for c in item.content] == [("reasoning_text", raw.strip())]
    assert out.usage.output_tokens_details.reasoning_tokens == out.usage.output_tokens == 6  # still thinking
    events = list(client.responses.create(stream=True, **kwargs))
    deltas = [e.delta for e in events if e.type == "response.reasoning_text.delta"]
    (done,) = [e for e in events if e.type == "response.reasoning_text.done"]
    assert "".join(deltas) == done.text == raw.strip()
    assert events[-1].response.output[0].content == item.content

    _, raw_off = written(server, ASK, 6, OFF)
    off = client.responses.create(**kwargs, reasoning={"effort": "minimal"})
    assert [i.type for i in off.output] == ["message"] and off.output[0].content[0].text == raw_off


def test_no_think_template_or_parser_none_leaves_the_text_as_written(server, smol_server):
    """SmolLM2's template writes no think block: its messages are as before, with no reasoning field; and
    --reasoning-parser none serves a think model's output whole as the answer."""
    ids = httpx.post(f"{smol_server.url}/tokenize", json={"messages": ASK}, timeout=120).json()["tokens"]
    raw = httpx.post(
        f"{smol_server.url}/v1/completions",
        json={"prompt": ids, "temperature": 0, "max_tokens": 8},
        timeout=120,
    )
    body = httpx.post(
        f"{smol_server.url}/v1/chat/completions",
        json={"messages": ASK, "temperature": 0, "max_tokens": 8},
        timeout=120,
    )
    assert body.json()["choices"][0]["message"] == {
        "role": "assistant",
        "content": raw.json()["choices"][0]["text"],
    }

    close = server.ids["</think>"]
    _, raw_think = written(server, ASK, 10, allowed_token_ids=[server.ids[" b"], close])
    plain = ServerProcess(
        server.model, "--served-model-name", "tiny", "--max-model-len", "512", "--reasoning-parser", "none"
    )
    try:
        out = httpx.post(
            f"{plain.url}/v1/chat/completions",
            json={
                "messages": ASK,
                "temperature": 0,
                "max_tokens": 10,
                "allowed_token_ids": [server.ids[" b"], close],
            },
            timeout=120,
        )
        assert out.json()["choices"][0]["message"] == {"role": "assistant", "content": raw_think}
        assert "</think>" in raw_think
    finally:
        assert plain.stop() == 0


def test_a_grammar_holds_after_the_reasoning(server):
    """response_format leaves the think block free and holds the answer after it: the reasoning is what the model
    writes without the grammar (braces and all); the answer is JSON."""
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    tok = AutoTokenizer.from_pretrained(server.model)
    brace, end = (tok.encode(t, add_special_tokens=False)[0] for t in ("{", "}"))
    b, close = server.ids[" b"], server.ids["</think>"]
    eos = tok.eos_token_id  # the only token the grammar allows after "{}": there, and never before it
    for allowed in ([b, brace, end], [b, close, brace, end]):
        _, raw = written(server, ASK, 16, allowed_token_ids=allowed)
        reasoning, _ = cut(raw)
        kwargs = dict(model="tiny", messages=ASK, temperature=0, max_tokens=16,
                      response_format={"type": "json_object"},
                      extra_body={"allowed_token_ids": [*allowed, eos], "logit_bias": {str(eos): -100}})
        msg = client.chat.completions.create(**kwargs).choices[0].message
        if "</think>" in raw:
            assert msg.reasoning_content == reasoning and json.loads(msg.content) == {}
        else:  # still thinking at max_tokens: all of it reasoning, free of the grammar
            assert (msg.reasoning_content, msg.content) == (reasoning, "")
        chunks = [c.choices[0].delta for c in client.chat.completions.create(stream=True, **kwargs) if c.choices]
        assert "".join(d.model_extra.get("reasoning_content") or "" for d in chunks) == (reasoning or "")
        assert "".join(d.content or "" for d in chunks) == msg.content
    assert "</think>" in raw  # the second closed its block
