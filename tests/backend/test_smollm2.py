"""The bundled default model (SmolLM2-135M-Instruct, GGUF Q4_1) against transformers loading the same file.

Both paths are exact: the file dequantized at load, and the default, whose weights stay quantized and are
decoded inside our CPU kernel in fp32 (the same weights, summed in another order), give transformers' tokens.
"""

import json
import os
import subprocess
import sys

import pytest
import torch

from backend import LLM, SamplingParams
from tests.backend.hf_gguf import transformers_tokenizer_and_model
from tests.backend.price_function import PRICE_FUNCTION

PROMPTS = [
    "The capital of France is",
    "Write a short poem about the sea:",
    "def fibonacci(n):",
    "Scribes in medieval monasteries copied manuscripts by hand. The most important tools of a scribe were",
]


@pytest.fixture(scope="module")
def llm(smollm2_path):
    return LLM("smollm2", block_size=16)


@pytest.fixture(scope="module")
def exact(smollm2_path):
    return LLM("smollm2", block_size=16, quantization="dequantize")


@pytest.fixture(scope="module")
def reference(smollm2_path):
    return transformers_tokenizer_and_model(smollm2_path)


@pytest.fixture(scope="module")
def hf_runs(reference) -> list[list[int]]:
    """Each prompt and transformers' 64 greedy tokens after it (a prefix of them is its shorter greedy run)."""
    return hf_continuations(reference, 64)


def hf_continuations(reference, n: int) -> list[list[int]]:
    tokenizer, model = reference
    out = []
    for prompt in PROMPTS:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            full = model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, eos_token_id=None,
                                  pad_token_id=tokenizer.pad_token_id)[0]
        out.append(full.tolist())
    return out


def test_64_greedy_tokens_match_transformers_in_one_batch(exact, reference, hf_runs):
    tokenizer, _ = reference
    outputs = exact.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=64, ignore_eos=True), use_tqdm=False)
    for prompt, out, full in zip(PROMPTS, outputs, hf_runs):
        ids = tokenizer(prompt).input_ids
        assert out.prompt_token_ids == ids
        expected = full[len(ids):]
        assert out.outputs[0].token_ids == expected, prompt
        assert out.outputs[0].text == tokenizer.decode(expected, skip_special_tokens=True)


def test_quantized_weights_give_transformers_tokens(llm, reference, hf_runs):
    """The quantized default: transformers' 64 greedy tokens on every prompt, and teacher-forced logits within
    1e-4 of its own (summation order is all that differs)."""
    from tests.backend.test_models_vs_transformers import prefill_logits

    tokenizer, model = reference
    for full in hf_runs:  # first: a prefill with nothing cached yet
        ours = prefill_logits(llm, [full])[0]
        with torch.no_grad():
            theirs = model(torch.tensor([full])).logits[0]
        rel = ((ours - theirs).norm(dim=-1) / theirs.norm(dim=-1)).max().item()
        assert rel < 1e-4, rel
    outputs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=64, ignore_eos=True), use_tqdm=False)
    for prompt, out, full in zip(PROMPTS, outputs, hf_runs):
        assert out.outputs[0].token_ids == full[len(tokenizer(prompt).input_ids):], prompt
    layer = llm.engine.model.model.layers[0].mlp.gate_up_proj
    assert layer.parts[0].name == "Q4_1" and layer.parts[0].codes is not None


def test_greedy_speculation_reproduces_plain_decoding(llm):
    """n-gram drafts verified in chunks give the plain greedy tokens exactly: each verification row attends
    as a decode row would (before, this edit diverged at its 79th token)."""
    conversation = [{"role": "user", "content": f"Rename the variable `subtotal` to `net` in this Python function. "
                                                f"Reply with the full updated function only.\n\n{PRICE_FUNCTION}"}]
    params = SamplingParams(temperature=0, max_tokens=100)
    plain = llm.chat([conversation], params, use_tqdm=False)[0].outputs[0].token_ids
    spec = LLM("smollm2", block_size=16, speculative={"method": "ngram", "num_tokens": "auto"})
    assert spec.chat([conversation], params, use_tqdm=False)[0].outputs[0].token_ids == plain
    stats = spec.engine.stats()
    assert stats["spec_accepted_tokens"] > 20  # it did speculate, and most of the edit came from drafts


def test_chat_applies_the_gguf_chat_template_and_stops_at_eos(llm, reference):
    tokenizer, _ = reference
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    out = llm.chat(messages, SamplingParams(temperature=0, max_tokens=64), use_tqdm=False)[0]
    expected_prompt = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    if isinstance(expected_prompt, dict) or hasattr(expected_prompt, "input_ids"):
        expected_prompt = expected_prompt["input_ids"]
    assert out.prompt_token_ids == list(expected_prompt)
    assert "<|im_start|>assistant" in out.prompt
    completion = out.outputs[0]
    assert "Paris" in completion.text
    assert completion.finish_reason == "stop"
    assert completion.token_ids[-1] == tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert "<|im_end|>" not in completion.text


def test_generate_cli_prints_the_completion(llm, smollm2_path):
    env = dict(os.environ)
    result = subprocess.run(
        [sys.executable, "-m", "backend", "generate", "--model", "smollm2", "--max-tokens", "12", "--json",
         PROMPTS[0]], capture_output=True, text=True, env=env, timeout=300,
    )
    assert result.returncode == 0, result.stderr
    printed = json.loads(result.stdout)
    expected = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0].outputs[0]
    assert printed["text"] == expected.text
    assert printed["token_ids"] == expected.token_ids
