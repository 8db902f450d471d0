"""Every API for the latent-attention family: one real server of a tiny DeepSeek-V2 (latent attention, softmax
router, shared experts), driven by the official openai SDK (chat completions streamed and not, completions,
responses) and anthropic SDK (messages streamed and not); each writes what the offline LLM writes greedily for
the same prompt ids. Its ready log counts the latent row's bytes a token."""

import json
import re

import anthropic
import httpx
import openai
import pytest

from backend import LLM, SamplingParams
from tests.backend.server_process import ServerProcess

ASK = [{"role": "user", "content": "Copy the manuscript."}]
PROMPT = "The scribe copied"
TOKENS = 6


@pytest.fixture(scope="module")
def model(tiny_dir):
    return tiny_dir("deepseek_v2")


@pytest.fixture(scope="module")
def server(model, tmp_path_factory):
    log = tmp_path_factory.mktemp("deepseek-api") / "server.log"
    proc = ServerProcess(
        str(model),
        "--served-model-name",
        "tiny",
        "--max-model-len",
        "256",
        "--log-level",
        "info",
        log_path=log,
    )
    proc.log = log
    yield proc
    assert proc.stop() == 0


@pytest.fixture(scope="module")
def offline(model):
    """(text, token count) the offline LLM writes greedily after prompt ids."""
    llm = LLM(str(model), max_model_len=256)

    def written(ids: list[int]) -> tuple[str, int]:
        params = SamplingParams(temperature=0, max_tokens=TOKENS)
        out = llm.generate([ids], params, use_tqdm=False)[0].outputs[0]
        assert len(out.token_ids) == TOKENS  # no end token before: the comparison covers every token
        return out.text, len(out.token_ids)

    written.llm = llm
    return written


def prompt_ids(server, **body) -> list[int]:
    return httpx.post(f"{server.url}/tokenize", json={"model": "tiny", **body}, timeout=60).json()["tokens"]


def test_openai_chat_completions_and_responses_write_the_offline_tokens(server, offline):
    text, count = offline(prompt_ids(server, messages=ASK))
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)
    chat = dict(model="tiny", messages=ASK, temperature=0, max_tokens=TOKENS)
    out = client.chat.completions.create(**chat)
    assert (out.choices[0].message.content, out.usage.completion_tokens) == (text, count)
    chunks = [
        c.choices[0].delta.content or ""
        for c in client.chat.completions.create(stream=True, **chat)
        if c.choices
    ]
    assert "".join(chunks) == text
    response = client.responses.create(model="tiny", input=ASK, temperature=0, max_output_tokens=TOKENS)
    assert (response.output_text, response.usage.output_tokens) == (text, count)

    raw_text, raw_count = offline(prompt_ids(server, prompt=PROMPT))
    completion = client.completions.create(model="tiny", prompt=PROMPT, temperature=0, max_tokens=TOKENS)
    assert (completion.choices[0].text, completion.usage.completion_tokens) == (raw_text, raw_count)


def test_anthropic_messages_write_the_offline_tokens_streamed_and_not(server, offline):
    text, count = offline(prompt_ids(server, messages=ASK))
    client = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=120)
    # the SDK's create() no longer takes temperature; the API still does
    ask = dict(model="tiny", messages=ASK, max_tokens=TOKENS, extra_body={"temperature": 0})
    out = client.messages.create(**ask)
    assert ([b.text for b in out.content], out.usage.output_tokens) == ([text], count)
    with client.messages.stream(**ask) as stream:
        assert "".join(stream.text_stream) == text


def test_the_ready_log_counts_the_latent_rows_bytes_a_token(server, model, offline):
    """One row of kv_lora_rank + qk_rope_head_dim a token a layer (from config.json), in the cache's dtype."""
    cfg = json.loads((model / "config.json").read_text())
    itemsize = offline.llm.engine.shape.kv_dtype.itemsize  # the same defaults as the server's
    per_token = cfg["num_hidden_layers"] * (cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"]) * itemsize
    [line] = [line for line in server.log.read_text().splitlines() if "KV cache:" in line]
    assert re.search(rf"KV cache: \d+ blocks of \d+ tokens \({per_token} bytes a token\)", line), line
