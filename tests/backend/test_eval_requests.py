"""What evaluation harnesses send, against a real server through the official OpenAI SDK: lm-evaluation-harness's
loglikelihood requests (token-id prompts, echo, logprobs 1, max_tokens 1 or 0, several prompts at once), vLLM's
prompt_logprobs on completions and chat, GET /tokenizer_info with /tokenize as lm-eval's remote tokenizer uses
them, and fields the server does not know (ignored and logged; vLLM's that would change the output refused).
The prompt logprobs are checked against transformers' log-softmax on the same weights."""

import json

import httpx
import openai
import pytest
import torch

from tests.backend.conftest import prompts_of_lengths
from tests.backend.server_process import ServerProcess

TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def server(tiny_dir, tmp_path_factory):
    # 16 tokens a step: a 45-token prompt takes three prefill chunks; the log is read for ignored fields
    proc = ServerProcess(str(tiny_dir("llama")), "--served-model-name", "tiny", "--block-size", "8",
                         "--max-num-batched-tokens", "16", log_path=tmp_path_factory.mktemp("log") / "server.log")
    yield proc
    assert proc.stop() == 0


@pytest.fixture(scope="module")
def reference(tiny_dir, hf_model):
    def logprobs(prompt: list[int]) -> torch.Tensor:
        with torch.no_grad():
            logits = hf_model(tiny_dir("llama"))(torch.tensor([prompt])).logits[0].float()
        return torch.log_softmax(logits, dim=-1)  # row p: the distribution of token p + 1
    return logprobs


def loglikelihood(choice: dict, ctxlen: int) -> tuple[float, bool]:
    """lm-evaluation-harness's reading of a local-completions answer (its parse_logprobs)."""
    token_logprobs = choice["logprobs"]["token_logprobs"][ctxlen:-1]
    tops = choice["logprobs"]["top_logprobs"][ctxlen:-1]
    return sum(token_logprobs), all(tok == max(top.values()) for tok, top in zip(token_logprobs, tops))


def test_lm_eval_loglikelihood_requests_match_transformers(client, reference):
    context, continuation = prompts_of_lengths(40, 5)
    prompt = context + continuation  # 45 tokens: three prefill chunks
    expected = reference(prompt)
    body = client.completions.create(model="tiny", prompt=[prompt], max_tokens=1, logprobs=1, echo=True,
                                     temperature=0).model_dump()
    choice = body["choices"][0]
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(prompt) + 1 and lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    for p in range(1, len(prompt)):
        assert lp["token_logprobs"][p] == pytest.approx(expected[p - 1, prompt[p]].item(), abs=TOLERANCE)
        top_token = max(lp["top_logprobs"][p], key=lp["top_logprobs"][p].get)
        assert lp["top_logprobs"][p][top_token] == pytest.approx(expected[p - 1].max().item(), abs=TOLERANCE)
    assert lp["text_offset"] == sorted(lp["text_offset"]) and lp["text_offset"][0] == 0
    prompt_text = "".join(lp["tokens"][:len(prompt)])
    assert choice["text"].startswith(prompt_text) and lp["text_offset"][len(prompt)] == len(prompt_text)
    assert body["usage"]["prompt_tokens"] == len(prompt) and body["usage"]["completion_tokens"] == 1

    total, greedy = loglikelihood(choice, len(context))
    rows = expected[len(context) - 1:len(prompt) - 1]
    assert total == pytest.approx(rows.gather(1, torch.tensor(continuation)[:, None]).sum().item(), abs=1e-3)
    assert greedy == bool((rows.argmax(dim=1) == torch.tensor(continuation)).all())

    # max_tokens 0: the prompt and its logprobs alone
    alone = client.completions.create(model="tiny", prompt=prompt, max_tokens=0, logprobs=1, echo=True,
                                      temperature=0).model_dump()
    only = alone["choices"][0]
    assert only["text"] == prompt_text and only["finish_reason"] == "length"
    assert only["logprobs"]["token_logprobs"] == lp["token_logprobs"][:len(prompt)]
    assert alone["usage"]["completion_tokens"] == 0
    with pytest.raises(openai.BadRequestError, match="max_tokens must be at least 1, or 0 with echo"):
        client.completions.create(model="tiny", prompt=prompt, max_tokens=0)


def test_batched_and_prefix_cached_prompts_give_each_its_own_logprobs(client, reference):
    first, second = prompts_of_lengths(12, 30)
    client.completions.create(model="tiny", prompt=second, max_tokens=1, temperature=0)  # now in the prefix cache
    body = client.completions.create(model="tiny", prompt=[first, second], max_tokens=1, logprobs=2, echo=True,
                                     temperature=0).model_dump()
    assert [c["index"] for c in body["choices"]] == [0, 1]
    for choice, prompt in zip(body["choices"], (first, second)):
        expected = reference(prompt)
        got = choice["logprobs"]["token_logprobs"][1:len(prompt)]
        want = [expected[p - 1, prompt[p]].item() for p in range(1, len(prompt))]
        assert max(abs(a - b) for a, b in zip(got, want)) < TOLERANCE
        assert all(1 <= len(top) <= 3 for top in choice["logprobs"]["top_logprobs"][1:])  # texts may coincide


def test_streamed_echo_matches_the_whole_answer(client):
    prompt = prompts_of_lengths(20)[0]
    whole = client.completions.create(model="tiny", prompt=prompt, max_tokens=4, logprobs=1, echo=True,
                                      temperature=0).choices[0]
    text, token_logprobs, offsets = "", [], []
    for chunk in client.completions.create(model="tiny", prompt=prompt, max_tokens=4, logprobs=1, echo=True,
                                           temperature=0, stream=True):
        for c in chunk.choices:
            text += c.text
            if c.logprobs:
                token_logprobs += c.logprobs.token_logprobs
                offsets += c.logprobs.text_offset
    assert text == whole.text and token_logprobs == whole.logprobs.token_logprobs
    assert offsets == whole.logprobs.text_offset


def test_vllm_prompt_logprobs_on_completions_and_chat(client, server, reference):
    prompt = prompts_of_lengths(18)[0]
    expected = reference(prompt)
    body = client.completions.create(model="tiny", prompt=prompt, max_tokens=2, temperature=0,
                                     extra_body={"prompt_logprobs": 1}).model_dump()
    entries = body["choices"][0]["prompt_logprobs"]
    assert len(entries) == len(prompt) and entries[0] is None
    for p in range(1, len(prompt)):
        assert entries[p][str(prompt[p])]["logprob"] == pytest.approx(expected[p - 1, prompt[p]].item(), abs=TOLERANCE)
        assert any(e["rank"] == 1 for e in entries[p].values())
    assert body["choices"][0]["text"] and "prompt_logprobs" not in client.completions.create(
        model="tiny", prompt=prompt, max_tokens=1).model_dump()["choices"][0]

    messages = [{"role": "user", "content": "hello there"}]
    chat = client.chat.completions.create(model="tiny", messages=messages, max_tokens=2, temperature=0,
                                          extra_body={"prompt_logprobs": 0}).model_dump()
    ids = httpx.post(f"{server.url}/tokenize", json={"model": "tiny", "messages": messages}).json()["tokens"]
    chat_expected = reference(ids)
    got = chat["prompt_logprobs"]
    assert len(got) == len(ids) and got[0] is None
    assert got[-1][str(ids[-1])]["logprob"] == pytest.approx(chat_expected[-2, ids[-1]].item(), abs=TOLERANCE)
    streamed = [json.loads(line[6:]) for line in httpx.post(
        f"{server.url}/v1/chat/completions", json={"model": "tiny", "messages": messages, "max_tokens": 2,
                                                   "temperature": 0, "stream": True, "prompt_logprobs": 0},
        timeout=60).text.splitlines() if line.startswith("data: {")]
    assert [c["prompt_logprobs"] for c in streamed if "prompt_logprobs" in c] == [got]


def test_tokenizer_info_serves_lm_evals_remote_tokenizer(server):
    info = httpx.get(f"{server.url}/tokenizer_info").json()
    assert "eos_token" in info and info["model_max_length"] > 0 and info["tokenizer_class"]
    tokens = httpx.post(f"{server.url}/tokenize", json={"prompt": "test", "add_special_tokens": False}).json()
    assert isinstance(tokens["tokens"], list) and tokens["tokens"]
    back = httpx.post(f"{server.url}/detokenize", json={"tokens": tokens["tokens"]}).json()["prompt"]
    assert back == "test"


def test_unknown_fields_are_ignored_and_logged_and_unsupported_ones_refused(client, server):
    answer = client.completions.create(model="tiny", prompt="hi", max_tokens=1,
                                       extra_body={"frobnicate_level": 3})
    assert answer.choices[0].finish_reason in ("length", "stop")
    assert "ignored fields the server does not use: frobnicate_level" in server.log_path.read_text()
    for field, value in (("min_tokens", 4), ("use_beam_search", True), ("guided_regex", "a+")):
        with pytest.raises(openai.BadRequestError) as refused:
            client.completions.create(model="tiny", prompt="hi", max_tokens=1, extra_body={field: value})
        assert f"{field} is not supported by this server" in str(refused.value)
    with pytest.raises(openai.BadRequestError, match="echo is not supported"):
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=1,
                                       extra_body={"echo": True})
