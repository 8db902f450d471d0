"""gpt-oss's harmony channels through the real server and the official openai SDK: the reasoning in
reasoning_content, the final channel as the answer, a commentary call after the reasoning as a tool call,
streamed and not; the reader chosen from the chat template alone.

The model is a tiny gpt-oss whose layers add nothing (their output projections zeroed) and whose embeddings and
lm_head make it a bigram machine: each token of a harmony output's script predicts the next. Its tokenizer has
harmony's markers as special tokens, as gpt-oss's has; a marker written twice in the script is spelled the second
time by two ordinary added tokens of the same text, so that each token has one successor. A second-best successor
at two places (the channel after the reasoning, the message's body) spells a tool call instead, taken where
allowed_token_ids leaves out the best one.
"""

import json

import anthropic
import httpx
import openai
import pytest
import torch

from tests.backend.server_process import ServerProcess
from tests.backend.tiny_models import build_model

MARKERS = ["<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>", "<|call|>", "<|constrain|>"]
CALL_ARGS = '{"city": "Paris"}'
SCRIPT = [
    "assistant",
    "<|channel|>",
    "analysis",
    "<|message|>",
    " Weigh",
    " a",
    " b.",
    "<|end|>",
    "<|start|>",
    "assis",
    "tant",
    "<|chan",
    "nel|>",
    "final",
    "<|mes",
    "sage|>",
    " The",
    " answer.",
    "<|return|>",
]
SECOND = {"nel|>": "commentary", "sage|>": CALL_ARGS}  # the tool call's branch points
CALL_SCRIPT = ["commentary", " to=functions.get_weather", "<|constrain|>", "json", "<|mes"]
# gpt-oss's template's ways, cut down: reasoning sent back is rendered from `thinking` as an analysis message
TEMPLATE = (
    "{% for m in messages %}{% if m.thinking %}<|start|>assistant<|channel|>analysis<|message|>"
    "{{ m.thinking }}<|end|>{% endif %}<|start|>{{ m.role }}{% if m.role == 'assistant' %}<|channel|>final"
    "{% endif %}<|message|>{{ m.content }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|start|>assistant{% endif %}"
)
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
ASK = [{"role": "user", "content": "hi"}]


def successors() -> dict[str, list[str]]:
    """Each script token's successors, best first."""
    nexts = {a: [b] for a, b in zip(SCRIPT, SCRIPT[1:])}
    nexts.update({a: [b] for a, b in zip(CALL_SCRIPT, CALL_SCRIPT[1:])})
    nexts[CALL_ARGS] = ["<|call|>"]
    for at, second in SECOND.items():
        nexts[at].append(second)
    return nexts


def build_machine(directory):
    from safetensors.torch import load_file, save_file
    from transformers import AutoTokenizer

    build_model("gpt_oss", directory, chat_template=TEMPLATE)
    tokenizer = AutoTokenizer.from_pretrained(str(directory))
    tokenizer.add_special_tokens({"additional_special_tokens": MARKERS})
    words = sorted({t for t in SCRIPT + CALL_SCRIPT + [CALL_ARGS]} - set(MARKERS))
    tokenizer.add_tokens(words)
    tokenizer.save_pretrained(str(directory))
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in words + MARKERS}
    assert len(set(ids.values())) == len(ids) and max(ids.values()) < 512
    tensors = load_file(str(directory / "model.safetensors"))
    for name in tensors:
        if name.endswith(("o_proj.weight", "o_proj.bias", "experts.down_proj", "experts.down_proj_bias")):
            tensors[name] = torch.zeros_like(tensors[name])  # every layer adds nothing to the residual
    embed, head = tensors["model.embed_tokens.weight"], torch.zeros_like(tensors["lm_head.weight"])
    for k, (token, nexts) in enumerate(successors().items()):
        embed[ids[token]] = 0.0
        embed[ids[token], k] = 1.0  # each script token its own direction of the hidden state
        for rank, nxt in enumerate(nexts):
            head[ids[nxt], k] = 10.0 / (rank + 1)
    tensors["lm_head.weight"] = head
    save_file(tensors, str(directory / "model.safetensors"))
    for name in ("config.json", "generation_config.json"):
        cfg = json.loads((directory / name).read_text())
        cfg["eos_token_id"] = [ids["<|return|>"], ids["<|call|>"]]  # gpt-oss's stop tokens
        (directory / name).write_text(json.dumps(cfg))
    return ids


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    directory = tmp_path_factory.mktemp("harmony") / "tiny-harmony"
    ids = build_machine(directory)
    proc = ServerProcess(str(directory), "--served-model-name", "tiny", "--max-model-len", "512")
    proc.ids = ids
    yield proc
    assert proc.stop() == 0


def test_reasoning_and_answer_from_the_channels_streamed_and_not(server):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    kwargs = dict(model="tiny", messages=ASK, temperature=0, max_tokens=40)
    out = client.chat.completions.create(**kwargs)
    msg = out.choices[0].message
    assert (msg.reasoning_content, msg.content) == (" Weigh a b.", " The answer.")
    assert out.choices[0].finish_reason == "stop" and not msg.tool_calls
    chunks = [c.choices[0].delta for c in client.chat.completions.create(stream=True, **kwargs) if c.choices]
    assert "".join(d.model_extra.get("reasoning_content") or "" for d in chunks) == " Weigh a b."
    assert "".join(d.content or "" for d in chunks) == " The answer."
    # the analysis message's tokens, its header and <|end|> included, are the reasoning tokens
    analysis = SCRIPT.index("<|end|>")
    assert out.usage.completion_tokens_details.reasoning_tokens == analysis
    (last,) = [c for c in client.chat.completions.create(stream=True, stream_options={"include_usage": True},
                                                           **kwargs) if c.usage]
    assert last.usage.completion_tokens_details.reasoning_tokens == analysis
    # the plain completion of the same prompt is the harmony text itself (its markers special tokens: kept here)
    raw = client.completions.create(
        model="tiny",
        prompt="<|start|>user<|message|>hi<|end|><|start|>assistant",
        temperature=0,
        max_tokens=40,
        extra_body={"skip_special_tokens": False},
    )
    assert raw.choices[0].text == "".join(SCRIPT[1:])  # the stop token kept too


def test_a_commentary_call_after_the_reasoning_is_a_tool_call_streamed_and_not(server):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    allowed = [i for t, i in server.ids.items() if t not in ("final", " The")]
    kwargs = dict(
        model="tiny",
        messages=ASK,
        temperature=0,
        max_tokens=40,
        tools=[WEATHER],
        extra_body={"allowed_token_ids": allowed},
    )
    out = client.chat.completions.create(**kwargs)
    msg = out.choices[0].message
    assert out.choices[0].finish_reason == "tool_calls" and msg.reasoning_content == " Weigh a b."
    assert not msg.content
    assert [(c.function.name, json.loads(c.function.arguments)) for c in msg.tool_calls] == [
        ("get_weather", {"city": "Paris"})
    ]
    chunks = [c.choices[0] for c in client.chat.completions.create(stream=True, **kwargs) if c.choices]
    calls = [c for ch in chunks for c in ch.delta.tool_calls or []]
    assert [c.function.name for c in calls if c.id] == ["get_weather"]
    assert json.loads("".join(c.function.arguments or "" for c in calls)) == {"city": "Paris"}
    assert "".join(ch.delta.model_extra.get("reasoning_content") or "" for ch in chunks) == " Weigh a b."
    assert chunks[-1].finish_reason == "tool_calls"


def test_messages_and_responses_take_the_reasoning_apart_streamed_and_not(server):
    messages = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)
    kwargs = dict(model="tiny", messages=ASK, max_tokens=40, extra_body={"temperature": 0})

    def blocks(message) -> list[tuple]:
        return [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in message.content]

    out = messages.messages.create(**kwargs)
    assert blocks(out) == [("thinking", " Weigh a b."), ("text", " The answer.")]
    with messages.messages.stream(**kwargs) as stream:
        deltas = [e.delta.type for e in stream if e.type == "content_block_delta"]
        assert blocks(stream.get_final_message()) == blocks(out)
    assert "thinking_delta" in deltas and "text_delta" in deltas
    responses = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    kwargs = dict(model="tiny", input="hi", max_output_tokens=40, temperature=0)
    out = responses.responses.create(**kwargs)
    assert [i.type for i in out.output] == ["reasoning", "message"]
    assert out.output[0].content[0].text == " Weigh a b." and out.output_text == " The answer."
    assert out.usage.output_tokens_details.reasoning_tokens == SCRIPT.index("<|end|>")
    events = list(responses.responses.create(stream=True, **kwargs))
    assert events[-1].response.usage.output_tokens_details.reasoning_tokens == SCRIPT.index("<|end|>")
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == " Weigh a b."
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == " The answer."


def test_reasoning_sent_back_is_rendered_as_the_template_reads_it(server):
    """reasoning_content on an assistant message of the history reaches gpt-oss's template as `thinking`."""

    def prompt(assistant: dict) -> list[int]:
        history = [
            *ASK,
            {"role": "assistant", "content": "hello", **assistant},
            {"role": "user", "content": "bye"},
        ]
        return httpx.post(f"{server.url}/tokenize", json={"model": "tiny", "messages": history}).json()[
            "tokens"
        ]

    with_reasoning, without = prompt({"reasoning_content": " Weigh a b."}), prompt({})
    added = [server.ids[t] for t in ("<|start|>", *SCRIPT[:8])]  # the script's analysis message, as the template writes it
    at = without.index(server.ids["<|end|>"]) + 1  # after the user's message
    assert with_reasoning == without[:at] + added + without[at:]
