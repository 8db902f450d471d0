"""A prompt chunk's attention by our C kernel (csrc/cpu_chunk_attention.c) against causal attention in float64 over
the gathered cache, and a tiny model's prompt computed in many chunks against transformers."""

import pytest
import torch

from backend import LLM, SamplingParams
from backend.kernels import native
from backend.kernels.attention import prefill_attention
from backend.kernels.step_paths import C, chunk_kernel
from tests.backend.conftest import hf_greedy, prompts_of_lengths, use_kernel_build

# (rows, context, query heads a kv head, head dim, window, sinks): short and long chunks, fresh prompts and cached
# prefixes, contexts off the block edges, a context long enough that a chunk's keys are split across threads
CASES = [
    (1, 1, 1, 64, None, False),
    (7, 7, 3, 64, None, True),
    (8, 2_100, 3, 64, None, False),
    (33, 50, 4, 128, 20, True),
    (130, 207, 1, 256, 64, False),
    (130, 301, 3, 64, 97, True),
]


def reference(q, k_cache, v_cache, table, context_len, scale, window, sinks):
    """Causal attention in float64 over the context's keys and values gathered from the cache."""
    s, hq, d = q.shape
    hkv, bs = k_cache.shape[2], k_cache.shape[1]
    slots = torch.tensor([int(table[p // bs]) * bs + p % bs for p in range(context_len)])
    # NaN where the window has given blocks back: masked, but 0 * NaN would still reach every sum
    k = k_cache.reshape(-1, hkv, d)[slots].double().nan_to_num().repeat_interleave(hq // hkv, dim=1)
    v = v_cache.reshape(-1, hkv, d)[slots].double().nan_to_num().repeat_interleave(hq // hkv, dim=1)
    scores = torch.einsum("shd,khd->hsk", q.double(), k) * scale
    q_pos = torch.arange(context_len - s, context_len)[:, None]
    k_pos = torch.arange(context_len)[None, :]
    hidden = k_pos > q_pos
    if window is not None:
        hidden |= k_pos <= q_pos - window
    scores = scores.masked_fill(hidden[None], float("-inf"))
    if sinks is not None:  # one more logit in each softmax, weighing no value
        scores = torch.cat([scores, sinks.double()[:, None, None].expand(hq, s, 1)], dim=-1)
    weights = torch.softmax(scores, dim=-1)[..., :context_len]
    return torch.einsum("hsk,khd->shd", weights, v)


def random_chunk(case, dtype, generator):
    """A cache of dtype with the context at shuffled blocks, garbage in the others; NaN in the blocks before the
    window's reach (a sliding group gives them back: they must not be read)."""
    s, context, group, d, window, with_sinks = case
    hkv, bs = 2, 16
    blocks = (context + bs - 1) // bs
    k_cache = (torch.randn(blocks + 5, bs, hkv, d, generator=generator) * 30).to(dtype)
    v_cache = (torch.randn(blocks + 5, bs, hkv, d, generator=generator) * 30).to(dtype)
    table = torch.randperm(blocks + 4, generator=generator)[:blocks]
    used = torch.randn(blocks, bs, hkv, d, generator=generator).to(dtype)
    k_cache[table], v_cache[table] = used, torch.randn(blocks, bs, hkv, d, generator=generator).to(dtype)
    if window is not None:
        first = max(0, context - s - window + 1) // bs
        table[:first] = blocks + 4
        k_cache[blocks + 4], v_cache[blocks + 4] = float("nan"), float("nan")
    q = torch.randn(s, hkv * group, d, generator=generator)
    sinks = torch.randn(hkv * group, generator=generator) if with_sinks else None
    return q, k_cache, v_cache, table, sinks


def assert_matches_reference(case, dtype, generator) -> None:
    s, context, group, d, window, _ = case
    q, k_cache, v_cache, table, sinks = random_chunk(case, dtype, generator)
    assert chunk_kernel(q, k_cache, v_cache) == C
    ours = prefill_attention(q, k_cache, v_cache, table, context, d**-0.5, window, sinks)
    expected = reference(q, k_cache, v_cache, table, context, d**-0.5, window, sinks)
    assert (ours.double() - expected).abs().max() <= 1e-5 * expected.abs().max()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(
    "case", CASES, ids=lambda c: f"S{c[0]}-ctx{c[1]}-g{c[2]}-d{c[3]}-w{c[4]}-sinks{c[5]}"
)
def test_a_chunk_attends_as_causal_attention_in_float64(case, dtype):
    if not native.enabled():
        pytest.skip("no C compiler for the CPU kernels")
    assert_matches_reference(case, dtype, torch.Generator().manual_seed(len(CASES) * case[0] + case[1]))


@pytest.mark.parametrize("build", ["avx2", "portable"])
def test_the_other_builds_attend_alike(build, monkeypatch):
    use_kernel_build(build, monkeypatch)
    generator = torch.Generator().manual_seed(5)
    for case in (CASES[2], CASES[3]):
        assert_matches_reference(case, torch.float16, generator)


@pytest.mark.parametrize("family", ["llama", "gpt_oss"])  # gpt-oss: a sliding window and sinks
def test_a_prompt_in_many_chunks_gives_transformers_logprobs_and_tokens(tiny_dir, hf_model, family):
    if not native.enabled():
        pytest.skip("no C compiler for the CPU kernels")
    directory = tiny_dir(family)
    llm = LLM(str(directory), block_size=8, max_num_batched_tokens=16)  # 150 tokens: ten chunks
    config = hf_model(directory).config
    d = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    cache = torch.zeros(1, 8, config.num_key_value_heads, d)
    assert chunk_kernel(torch.zeros(16, config.num_attention_heads, d), cache, cache) == C
    prompt = prompts_of_lengths(150)[0]
    params = SamplingParams(temperature=0, max_tokens=6, prompt_logprobs=0, ignore_eos=True)
    out = llm.generate(prompt, params, use_tqdm=False)[0]
    with torch.no_grad():
        expected = torch.log_softmax(hf_model(directory)(torch.tensor([prompt])).logits[0].float(), dim=-1)
    ours = torch.tensor([entry[token].logprob for entry, token in zip(out.prompt_logprobs[1:], prompt[1:])])
    torch.testing.assert_close(ours, expected[torch.arange(len(prompt) - 1), prompt[1:]], atol=1e-4, rtol=0)
    assert out.outputs[0].token_ids == hf_greedy(hf_model(directory), prompt, 6)
