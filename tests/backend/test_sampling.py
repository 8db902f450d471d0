"""Sampling against independent oracles: transformers' logits at every step, and exact distributions."""

import math

import pytest
import torch

from backend import LLM, SamplingParams
from backend.engine.sampler import Sampler
from backend.engine.sequence import Sequence
from tests.backend.conftest import hf_greedy, hf_next_logits, prompts_of_lengths

PROMPT = prompts_of_lengths(21)[0]


@pytest.fixture(scope="module")
def llm(tiny_dir):
    return LLM(str(tiny_dir("llama")), block_size=8)


@pytest.fixture(scope="module")
def reference(tiny_dir, hf_model):
    return hf_model(tiny_dir("llama"))


def test_seeded_output_is_the_same_alone_and_in_any_batch(llm):
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=24, ignore_eos=True)
    alone = llm.generate(PROMPT, params, use_tqdm=False)[0].outputs[0].token_ids
    others = prompts_of_lengths(5, 40, 13)
    noisy = SamplingParams(temperature=1.3, max_tokens=30, ignore_eos=True)
    batch = llm.generate(others[:2] + [PROMPT] + others[2:], [noisy, noisy, params, noisy], use_tqdm=False)
    assert batch[2].outputs[0].token_ids == alone
    unseeded = llm.generate([PROMPT] * 2, SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True),
                            use_tqdm=False)
    assert unseeded[0].outputs[0].token_ids != unseeded[1].outputs[0].token_ids


def _allowed(logits: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float) -> set[int]:
    """The tokens sampling may pick, written out plainly: rank by probability and walk the list."""
    probs = torch.softmax(logits / temperature, dim=-1).tolist()
    ranked = sorted(range(len(probs)), key=lambda i: -probs[i])
    if top_k:
        ranked = ranked[:top_k]
    mass = sum(probs[i] for i in ranked)
    kept, running = [], 0.0
    for i in ranked:
        if running >= top_p * mass - 1e-6:
            break
        kept.append(i)
        running += probs[i]
    best = probs[kept[0]]
    return {i for i in kept if probs[i] >= min_p * best - 1e-9}


@pytest.mark.parametrize("top_k,top_p,min_p", [(5, 1.0, 0.0), (0, 0.6, 0.0), (0, 1.0, 0.2), (8, 0.8, 0.05)])
def test_filtered_sampling_never_leaves_the_allowed_set(llm, reference, top_k, top_p, min_p):
    params = SamplingParams(temperature=1.5, top_k=top_k, top_p=top_p, min_p=min_p, seed=7, max_tokens=24,
                            ignore_eos=True)
    tokens = llm.generate(PROMPT, params, use_tqdm=False)[0].outputs[0].token_ids
    context = list(PROMPT)
    for token in tokens:
        allowed = _allowed(hf_next_logits(reference, context), 1.5, top_k, top_p, min_p)
        assert token in allowed
        context.append(token)


def test_draws_follow_the_filtered_distribution():
    """Exponential-race draws from a fixed distribution match its probabilities (10k draws, 5-sigma bounds)."""
    logits = torch.log(torch.tensor([0.4, 0.3, 0.15, 0.1, 0.05]))
    seq = Sequence(seq_id=0, request_id="r", index=0, token_ids=[0], num_prompt_tokens=1,
                   params=SamplingParams(temperature=1.0, top_k=3))
    sampler = Sampler(seed=0)
    draws = [sampler(logits[None].clone(), [seq])[0][0] for _ in range(10000)]
    expected = [0.4 / 0.85, 0.3 / 0.85, 0.15 / 0.85, 0, 0]
    for token, p in enumerate(expected):
        freq = draws.count(token) / len(draws)
        assert abs(freq - p) <= 5 * math.sqrt(max(p * (1 - p), 1e-12) / len(draws)) + 1e-9


def test_repetition_penalty_matches_transformers(llm, reference):
    out = llm.generate(PROMPT, SamplingParams(temperature=0, repetition_penalty=1.5, max_tokens=24,
                                              ignore_eos=True), use_tqdm=False)[0]
    with torch.no_grad():
        expected = reference.generate(torch.tensor([PROMPT]), max_new_tokens=24, do_sample=False,
                                      repetition_penalty=1.5, pad_token_id=0)[0, len(PROMPT):].tolist()
    assert out.outputs[0].token_ids == expected


def test_presence_and_frequency_penalties_follow_openai_formula(llm, reference):
    params = SamplingParams(temperature=0, presence_penalty=0.7, frequency_penalty=0.9, max_tokens=24,
                            ignore_eos=True)
    tokens = llm.generate(PROMPT, params, use_tqdm=False)[0].outputs[0].token_ids
    context = list(PROMPT)
    for step, token in enumerate(tokens):
        logits = hf_next_logits(reference, context)
        for t in set(tokens[:step]):  # only generated tokens count
            logits[t] -= 0.9 * tokens[:step].count(t) + 0.7
        assert token == int(logits.argmax())
        context.append(token)
    assert tokens != hf_greedy(reference, PROMPT, 24)  # the penalties changed something


def test_logprobs_match_transformers(llm, reference):
    out = llm.generate(PROMPT, SamplingParams(temperature=0, logprobs=3, max_tokens=8, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]
    assert len(out.logprobs) == 8
    context = list(PROMPT)
    total = 0.0
    for token, entry in zip(out.token_ids, out.logprobs):
        expected = torch.log_softmax(hf_next_logits(reference, context), dim=-1)
        top = torch.topk(expected, 3)
        assert set(entry) == {token} | set(top.indices.tolist())
        for tid, lp in entry.items():
            assert lp.logprob == pytest.approx(expected[tid].item(), abs=1e-4)
        assert entry[token].rank == 1  # greedy picks the most likely token
        assert [entry[t].rank for t in top.indices.tolist()] == [1, 2, 3]
        total += entry[token].logprob
        context.append(token)
    assert out.cumulative_logprob == pytest.approx(total, abs=1e-4)


def test_stop_strings_stop_token_ids_and_max_tokens(llm):
    base = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True), use_tqdm=False)
    text, tokens = base[0].outputs[0].text, base[0].outputs[0].token_ids
    assert base[0].outputs[0].finish_reason == "length" and len(tokens) == 40
    stop = text[len(text) // 2:len(text) // 2 + 3]
    assert stop.strip()
    out = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=40, stop=["@@never@@", stop],
                                              ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert out.text == text[:text.index(stop)]
    assert out.finish_reason == "stop" and out.stop_reason == stop

    target = tokens[10]
    out = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[target],
                                              ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == tokens[:tokens.index(target) + 1]
    assert out.finish_reason == "stop" and out.stop_reason == target


def test_eos_stops_unless_ignored(tiny_dir):
    llm = LLM(str(tiny_dir("llama")), block_size=8)
    tokens = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
                          use_tqdm=False)[0].outputs[0].token_ids
    eos = tokens[12]
    llm.engine.eos_token_ids = {eos}  # as if the model's config named this token its eos
    out = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=30), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == eos
    assert out.token_ids == tokens[:tokens.index(eos) + 1]
    ignored = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
                           use_tqdm=False)[0].outputs[0]
    assert ignored.token_ids == tokens and ignored.finish_reason == "length"


def test_logit_bias_as_openai_defines_it(tiny_dir):
    """+100 on a token makes it every greedy choice, -100 on the greedy choice bans it; the same under n-gram
    speculation (drafts verified against the biased distribution) as without; ids outside the vocabulary are
    refused naming the id; biases are kept in [-100, 100]."""
    from backend.sampling_params import InvalidParameter

    model = str(tiny_dir("llama"))
    prompts = prompts_of_lengths(7, 20)
    plain, spec = LLM(model, block_size=16), LLM(model, block_size=16, speculative={
        "method": "ngram", "num_tokens": 3, "prompt_lookup_min": 1})

    def greedy(llm, bias=None) -> list[list[int]]:
        params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logit_bias=bias)
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]

    unbiased = greedy(plain)
    forced = 123 if unbiased[0][0] != 123 else 124
    assert greedy(plain, {forced: 100}) == [[forced] * 8] * 2
    banned = greedy(plain, {str(unbiased[0][0]): -100.0})  # ids as JSON carries them: strings
    assert banned[0][0] != unbiased[0][0] and unbiased[0][0] not in banned[0]
    bias = {unbiased[1][1]: -100, unbiased[0][2]: 5.5}
    assert greedy(spec, bias) == greedy(plain, bias) != unbiased
    assert spec.engine.stats()["spec_draft_tokens"] > 0
    with pytest.raises(InvalidParameter, match="token id 5000 is not in the vocabulary"):
        plain.generate(prompts[0], SamplingParams(logit_bias={5000: 1}), use_tqdm=False)
    with pytest.raises(InvalidParameter, match="'x' is not a token id"):
        SamplingParams(logit_bias={"x": 1})
    assert SamplingParams(logit_bias={"3": 500, 4: -1e9}).logit_bias == {3: 100.0, 4: -100.0}
