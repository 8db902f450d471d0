"""Issue 57's families beyond gpt-oss and Gemma 3 (whose own tests walk the same paths: test_gpt_oss.py,
test_sliding_cache.py, test_gemma3.py) through the engine's paths against transformers: prompts longer than the
window batched with shorter ones, prompts in chunks across the window's edge beside decodes, a prefix-cache hit,
and n-gram speculation identical to plain decoding (Gemma 3's and gpt-oss's too); greedy tokens
identical and logprobs within 1e-4."""

import pytest

from backend import LLM, SamplingParams
from tests.backend.conftest import prompts_of_lengths
from tests.backend.test_gpt_oss import assert_as_transformers

# Phi-3 with a 24-token window, Phi-4-mini's partial rotary, SmolLM3's NoPE layers under 12-token windows, OLMoE,
# Granite-MoE with its shared expert (tiny_models.py)
FAMILIES = ["phi3", "phi4_partial_rotary", "smollm3_nope_windows", "olmoe", "granitemoe_shared"]
PROMPTS = prompts_of_lengths(3, 17, 33, 50)  # block_size 8; past the windows
NEW_TOKENS = 12
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_batched_chunked_and_cached_decoding_match_transformers(family, tiny_dir, hf_model):
    directory = tiny_dir(family)
    reference = hf_model(directory)
    batched = LLM(str(directory), block_size=8).generate(PROMPTS, GREEDY, use_tqdm=False)
    assert_as_transformers(reference, PROMPTS, batched, NEW_TOKENS)
    chunked = LLM(
        str(directory), block_size=8, max_num_batched_tokens=12
    )  # a chunk the window's length or half
    assert_as_transformers(reference, PROMPTS, chunked.generate(PROMPTS, GREEDY, use_tqdm=False), NEW_TOKENS)
    prefix = prompts_of_lengths(40)[0]
    first, second = prefix + [7, 8, 9], prefix + [11, 12, 13, 14, 15]
    llm = LLM(str(directory), block_size=8)
    llm.generate(first, GREEDY, use_tqdm=False)
    out = llm.generate(second, GREEDY, use_tqdm=False)[0]
    assert out.num_cached_tokens == 40
    assert_as_transformers(reference, [second], [out], NEW_TOKENS)


@pytest.mark.parametrize("family", [*FAMILIES, "gemma3", "gpt_oss"])
def test_ngram_speculation_decodes_as_plain_decoding(family, tiny_dir):
    """Drafts verified across the window's edge (prompts that repeat, longer than the window), batched: plain
    decoding's tokens and logprobs."""
    directory = str(tiny_dir(family))
    prompts = [prompts_of_lengths(20)[0] * 2, prompts_of_lengths(9)[0] * 3]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=0)
    plain = LLM(directory, block_size=8).generate(prompts, params, use_tqdm=False)
    spec = LLM(
        directory, block_size=8, speculative={"method": "ngram", "num_tokens": 4, "prompt_lookup_min": 1}
    )
    drafted = spec.generate(prompts, params, use_tqdm=False)
    for a, b in zip(plain, drafted):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert x.keys() == y.keys() and all(abs(x[t].logprob - y[t].logprob) < 1e-4 for t in x)
    assert spec.engine.stats()["spec_draft_tokens"] > 0
