"""Speculative decoding is lossless: the target's exact output (greedy) or distribution (sampling)."""

import math

import pytest
import torch

from backend import LLM, SamplingParams
from backend.model_config import ModelLoadError
from backend.speculative.ngram import propose_ngram
from backend.speculative.speculator import best_num_drafts
from tests.backend.conftest import prompts_of_lengths
from tests.backend.tiny_models import build_model

# Mixed lengths, and one prompt that repeats itself so prompt lookup finds matches.
PROMPTS = prompts_of_lengths(5, 30, 47) + [[5, 6, 7, 8, 9, 10] * 7]
GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)


def assert_no_leaks(llm: LLM) -> None:
    engine = llm.engine
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    draft = getattr(engine.proposer, "block_manager", None)
    if draft is not None:
        assert draft.num_free_blocks == draft.num_blocks and not engine.proposer.states


@pytest.mark.parametrize("target", ["llama", "mixtral"])
def test_greedy_output_is_identical_with_every_proposer(target, tiny_dir):
    directory = str(tiny_dir(target))
    expected = [o.outputs[0].token_ids for o in LLM(directory, block_size=8).generate(PROMPTS, GREEDY, use_tqdm=False)]
    other_family = str(tiny_dir("qwen2"))  # shares the 512-token vocabulary, disagrees with the target
    # Random tiny models rarely repeat a bigram, so lookups of a single token keep proposals coming.
    for spec in ({"method": "ngram", "num_tokens": 3, "prompt_lookup_min": 1}, {"method": "ngram", "prompt_lookup_min": 1},
                 {"method": "draft", "model": directory, "num_tokens": 4},
                 {"method": "draft", "model": other_family, "num_tokens": 3},
                 {"method": "draft", "model": other_family}):
        llm = LLM(directory, block_size=8, speculative=spec)
        outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outputs] == expected, spec
        stats = llm.engine.stats()
        if spec.get("model") == directory:  # the target drafting for itself is always right
            assert stats["spec_draft_tokens"] > 0 and stats["spec_accepted_tokens"] == stats["spec_draft_tokens"]
        elif spec["method"] == "ngram":
            assert stats["spec_draft_tokens"] > 0
        assert_no_leaks(llm)


def test_preemption_during_speculation_gives_identical_output(tiny_dir):
    directory = str(tiny_dir("llama"))
    prompts = prompts_of_lengths(20, 27, 35, 12)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in LLM(directory, block_size=8).generate(prompts, params, use_tqdm=False)]
    llm = LLM(directory, block_size=8, num_kv_blocks=14, max_model_len=100,
              speculative={"method": "draft", "model": str(tiny_dir("qwen2")), "num_tokens": 3})
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert_no_leaks(llm)


def test_stop_strings_max_tokens_penalties_and_logprobs_hold(tiny_dir):
    directory = str(tiny_dir("llama"))
    plain = LLM(directory, block_size=8)
    spec = LLM(directory, block_size=8, speculative={"method": "draft", "model": directory, "num_tokens": 5})
    text = plain.generate(PROMPTS[1], GREEDY, use_tqdm=False)[0].outputs[0].text
    for params in (SamplingParams(temperature=0, max_tokens=40, stop=[text[10:13]], ignore_eos=True),
                   SamplingParams(temperature=0, max_tokens=7, ignore_eos=True),
                   SamplingParams(temperature=0, max_tokens=30, repetition_penalty=1.4, frequency_penalty=0.5,
                                  ignore_eos=True),
                   SamplingParams(temperature=0, max_tokens=12, logprobs=2, ignore_eos=True)):
        a = plain.generate(PROMPTS[1], params, use_tqdm=False)[0].outputs[0]
        b = spec.generate(PROMPTS[1], params, use_tqdm=False)[0].outputs[0]
        assert (b.text, b.token_ids, b.finish_reason) == (a.text, a.token_ids, a.finish_reason)
        if params.logprobs:
            for x, y in zip(a.logprobs, b.logprobs):
                assert x.keys() == y.keys()
                assert all(abs(x[t].logprob - y[t].logprob) < 1e-4 for t in x)
                assert all(y[t].decoded_token == x[t].decoded_token is not None for t in x)  # accepted drafts' too
    assert spec.engine.stats()["spec_accepted_tokens"] > 0


def test_seeded_sampling_is_reproducible_alone_and_in_a_crowd(tiny_dir):
    directory = str(tiny_dir("llama"))
    llm = LLM(directory, block_size=8, speculative={"method": "draft", "model": str(tiny_dir("qwen2"))})
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=99, max_tokens=20, ignore_eos=True)
    alone = llm.generate(PROMPTS[0], seeded, use_tqdm=False)[0].outputs[0].token_ids
    noisy = SamplingParams(temperature=1.0, max_tokens=25, ignore_eos=True)
    crowd = prompts_of_lengths(3, 9, 14, 22, 31, 40)  # more than max_batch_size: others stop speculating
    outs = llm.generate(crowd + [PROMPTS[0]], [noisy] * len(crowd) + [seeded], use_tqdm=False)
    assert outs[-1].outputs[0].token_ids == alone
    assert_no_leaks(llm)


def _tv(p: dict, q: dict) -> float:
    return 0.5 * sum(abs(p.get(k, 0.0) - q.get(k, 0.0)) for k in set(p) | set(q))


@pytest.mark.parametrize("vocab", ["shared", "shuffled"])
def test_sampled_tokens_follow_the_target_distribution_exactly(tmp_path, vocab):
    """A 16-token vocabulary and a draft that disagrees with the target. The first token comes from the
    prompt's forward pass; the next two from verification (one draft: accepted or corrected, then the
    bonus). Given the first token, the verified token and the verified 2-token sequence must follow
    the target's exact distribution (from transformers) within a bound that the sample count justifies.
    shuffled: the same draft under a vocabulary of other ids, drafting by token-level intersection."""
    from transformers import AutoModelForCausalLM

    from tests.backend.vocab_pairs import build_permuted_draft

    target_dir = build_model("llama", tmp_path / "target", seed=1, vocab_size=16, initializer_range=0.5)
    draft_dir = build_model("llama", tmp_path / "draft", seed=2, vocab_size=16, initializer_range=0.5)
    drafter = draft_dir if vocab == "shared" else build_permuted_draft(draft_dir, tmp_path / "shuffled", drop=0,
                                                                       limit=16)[0]
    prompt = [3, 7, 5, 11]
    n = 8000
    llm = LLM(str(target_dir), block_size=4, max_num_seqs=512, max_num_batched_tokens=4096, seed=5,
              speculative={"method": "draft", "model": str(drafter), "num_tokens": 1, "max_batch_size": 10**6})
    assert (llm.engine.vocab_bridge is None) == (vocab == "shared")
    outs = llm.generate([prompt] * n, SamplingParams(temperature=1.0, max_tokens=3, ignore_eos=True), use_tqdm=False)
    stats = llm.engine.stats()
    # every request's later tokens came from verifications (a prompt whose last token a step left over may be
    # verified with a draft already, its next token then from a second verification)
    assert n <= stats["spec_verifications"] <= 2 * n
    assert 0.05 < stats["spec_accepted_tokens"] / stats["spec_draft_tokens"] < 0.95  # accepts and rejections

    def exact_pairs(model, context) -> dict:
        with torch.no_grad():
            first = torch.softmax(model(torch.tensor([context])).logits[0, -1], -1)
            second = torch.softmax(model(torch.tensor([context + [x] for x in range(16)])).logits[:, -1], -1)
        return {(a, b): float(first[a] * second[a, b]) for a in range(16) for b in range(16)}

    def marginal(pairs: dict) -> dict:
        out: dict = {}
        for (a, _), v in pairs.items():
            out[a] = out.get(a, 0.0) + v
        return out

    def empirical(samples: list) -> dict:
        counts: dict = {}
        for key in samples:
            counts[key] = counts.get(key, 0) + 1
        return {k: v / len(samples) for k, v in counts.items()}

    def bound(p: dict, m: int) -> float:
        # E[TV] <= 1/2 sum sqrt(p(1-p)/m); TV moves by at most 1/m per sample, so (McDiarmid) it exceeds
        # its mean by more than sqrt(ln(1/delta) / 2m) with probability < delta = 1e-6.
        return 0.5 * sum(math.sqrt(v * (1 - v) / m) for v in p.values()) + math.sqrt(math.log(1e6) / (2 * m))

    target = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32).eval()
    draft = AutoModelForCausalLM.from_pretrained(str(draft_dir), dtype=torch.float32).eval()
    by_first: dict = {}
    for o in outs:
        t = o.outputs[0].token_ids
        by_first.setdefault(t[0], []).append((t[1], t[2]))
    checked = 0
    for first, rest in sorted(by_first.items(), key=lambda kv: -len(kv[1]))[:2]:  # the two likeliest contexts
        context = prompt + [first]
        exact, drafts_own = exact_pairs(target, context), exact_pairs(draft, context)
        m = len(rest)
        assert m >= 1000
        assert _tv(empirical([a for a, _ in rest]), marginal(exact)) < bound(marginal(exact), m)
        assert _tv(empirical(rest), exact) < bound(exact, m)
        # The test has power: sampling from the draft alone would land far outside the bound.
        assert _tv(marginal(drafts_own), marginal(exact)) > 2 * bound(marginal(exact), m)
        checked += 1
    assert checked == 2


def test_draft_with_another_vocabulary_and_no_tokenizer_is_refused(tiny_dir, tmp_path):
    small = build_model("qwen2", tmp_path / "small-vocab", vocab_size=16)
    for f in small.glob("*"):
        if f.name.startswith(("tokenizer", "special_tokens", "vocab", "merges")):
            f.unlink()
    with pytest.raises(ModelLoadError, match="vocabulary of 16 tokens but the target has 512; a draft with another "
                                             "vocabulary needs a tokenizer"):
        LLM(str(tiny_dir("llama")), speculative={"method": "draft", "model": str(small)})


@pytest.mark.parametrize("spec,message", [
    ({"method": "medusa"}, "method 'medusa' is not supported; use one of ngram, draft"),
    ({"method": "ngram", "k": 3}, "unknown setting\\(s\\) k; allowed:"),
    ({"method": "draft"}, "needs a model"),
    ({"method": "ngram", "num_tokens": 0}, "num_tokens must be \"auto\" or an integer in \\[1, 16\\]"),
    ({"method": "ngram", "prompt_lookup_min": 4, "prompt_lookup_max": 2}, "prompt_lookup_min must be"),
    ("{not json", "must be a JSON object"),
])
def test_bad_speculative_settings(spec, message, tiny_dir):
    with pytest.raises(ValueError, match=message):
        LLM(str(tiny_dir("llama")), speculative=spec)


def test_prompt_lookup_proposes_what_followed_the_latest_match():
    tokens = [1, 2, 3, 9, 9, 1, 2, 3, 7, 8, 5, 1, 2, 3]
    assert propose_ngram(tokens, 2, 2, 3) == [7, 8]  # "1 2 3" last seen before "7 8"
    assert propose_ngram(tokens, 5, 2, 3) == [7, 8, 5, 1, 2]
    assert propose_ngram([4, 5, 6], 3, 2, 3) == []
    assert propose_ngram([1, 2, 1, 2], 3, 1, 1) == [1, 2]  # the match right before the last token


def test_auto_picks_more_drafts_the_more_are_accepted():
    ks = [best_num_drafts(a / 10, 8, 0.1) for a in range(11)]
    assert ks[0] == 0 and ks[-1] == 8
    assert ks == sorted(ks)
    assert best_num_drafts(0.9, 8, 1.0) < best_num_drafts(0.9, 8, 0.1)  # an expensive draft drafts less
