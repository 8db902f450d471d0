"""kv_cache_dtype float16 / bfloat16 on the CPU: keys and values rounded once, as PyTorch's .to() rounds them, and
read back exactly by every attention path; the engine then holds twice the tokens in the same memory."""

import math

import pytest
import torch

from backend import LLM, SamplingParams
from backend.arithmetic import pick_kv_dtype
from backend.kernels import native
from backend.kernels.attention import decode_attention, prefill_attention, verify_attention
from tests.backend.conftest import prompts_of_lengths
from tests.backend.test_kernels import dense_attention, impl, paged_contexts  # noqa: F401 (impl: a fixture)

HALVES = [torch.float16, torch.bfloat16]


@pytest.mark.parametrize("dtype", HALVES)
def test_the_c_store_rounds_as_torch_does(dtype, c_kernels):
    """Every build's conversion, bit for bit: normals of every range, fp16's subnormals and underflow, ties to even,
    overflow to infinity, signed zeros, infinities; NaN stays NaN."""
    g = torch.Generator().manual_seed(0)
    x = torch.cat([torch.randn(20000, generator=g) * s for s in (1e-9, 3e-6, 1e-3, 1.0, 300.0, 7e4, 1e38)] + [
        torch.tensor([65504.0, 65519.0, 65520.0, 2.0**-24, 2.0**-25, 1.5 * 2.0**-25, 0.0, -0.0, 1 + 2.0**-11,
                      1 + 3 * 2.0**-11, 1 + 2.0**-8, 1 + 3 * 2.0**-8, float("inf"), -float("inf")])])
    out = torch.empty(x.shape, dtype=dtype)
    native.library().kv_store(out.data_ptr(), x.data_ptr(), x.numel(), native.KV_KINDS[dtype])
    assert torch.equal(out.view(torch.int16), x.to(dtype).view(torch.int16))
    nan = torch.full((9,), float("nan"))
    native.library().kv_store(out.data_ptr(), nan.data_ptr(), 9, native.KV_KINDS[dtype])
    assert out[:9].isnan().all()


@pytest.mark.parametrize("dtype", HALVES)
@pytest.mark.parametrize(("window", "d"), [(None, 64), (300, 64), (None, 128), (300, 20)])
def test_attention_over_a_half_cache_is_attention_over_the_rounded_keys_and_values(dtype, window, d,
                                                                                    impl):  # noqa: F811
    """Decode rows (short and past one span of 256), verification rows and a prompt chunk over a 16-bit cache: the
    dense attention of the rounded keys and values, and verification rows keep decode rows' bits (head dims: the
    C kernel's two-head and one-head value sums, and its scalar loop)."""
    g = torch.Generator().manual_seed(5)
    hq, hkv, bs = 9, 3, 16
    lengths = [700, 5, 257, 40]
    # contexts: the keys and values as the 16-bit cache holds them
    k_cache, v_cache, tables, block_tables, contexts = paged_contexts(lengths, hkv, d, bs, 120, g, dtype)
    qs = [torch.randn(1, hq, d, generator=g) * 3 for _ in lengths]
    expected = [dense_attention(q, k, v, [n - 1], window) for q, (k, v), n in zip(qs, contexts, lengths)]
    scale = 1 / math.sqrt(d)
    ours = decode_attention(torch.cat(qs), k_cache, v_cache, block_tables, torch.tensor(lengths), scale, window)
    torch.testing.assert_close(ours, torch.cat(expected), atol=1e-5, rtol=1e-5)

    chunk, table, (k, v) = 6, torch.tensor(tables[0]), contexts[0]
    q = torch.randn(chunk, hq, d, generator=g)
    positions = list(range(lengths[0] - chunk, lengths[0]))
    rows = verify_attention(q, k_cache, v_cache, table, lengths[0], scale, window)
    torch.testing.assert_close(rows, dense_attention(q, k, v, positions, window), atol=1e-5, rtol=1e-5)
    for i in range(chunk):
        one = decode_attention(q[i:i + 1], k_cache, v_cache, table[None], torch.tensor([positions[i] + 1]), scale,
                               window, uniform_len=positions[i] + 1)
        assert torch.equal(rows[i:i + 1], one), i
    prefill = prefill_attention(q, k_cache, v_cache, table, lengths[0], scale, window)
    torch.testing.assert_close(prefill, dense_attention(q, k, v, positions, window), atol=1e-5, rtol=1e-5)


def greedy(llm: LLM, prompts, tokens: int = 16):
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True, logprobs=0)
    return [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]


def chosen_logprobs(out) -> list[float]:
    return [step[token].logprob for step, token in zip(out.logprobs, out.token_ids)]


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_an_engine_with_a_half_cache(tiny_gguf, dtype):
    """A quantized model decoding in the one-call C step (which stores keys and values itself), and through the
    modules (PyTorch's store and prefill attention): within the cache's rounding of the fp32-cache engine, with its
    greedy tokens; twice the blocks in the same memory; n-gram speculation stays exact."""
    path, _ = tiny_gguf("llama")
    prompts = prompts_of_lengths(12, 40, 300)  # 300: a prompt chunk through the module path's prefill attention
    half = LLM(str(path), block_size=8, kv_cache_dtype=dtype, kv_cache_memory=1 << 22)
    full = LLM(str(path), block_size=8, kv_cache_memory=1 << 22)
    engine = half.engine
    assert engine.runner.cpu_decoder is not None
    assert engine.model.model.layers[0].self_attn.k_cache.dtype == getattr(torch, dtype)
    assert engine.num_kv_blocks == 2 * full.engine.num_kv_blocks

    reference = greedy(full, prompts)
    tolerance = 0.02 if dtype == "float16" else 0.1
    ours = greedy(half, prompts)
    by_modules = LLM(str(path), block_size=8, kv_cache_dtype=dtype)
    by_modules.engine.runner.cpu_decoder = None  # every step through the modules
    modules = greedy(by_modules, prompts)
    for outs in (ours, modules):
        for a, b in zip(outs, reference):
            assert a.token_ids == b.token_ids
            assert max(abs(x - y) for x, y in zip(chosen_logprobs(a), chosen_logprobs(b))) < tolerance
        assert [chosen_logprobs(o) for o in outs] != [chosen_logprobs(o) for o in reference]  # really rounded

    spec = LLM(str(path), block_size=8, kv_cache_dtype=dtype, speculative={"method": "ngram", "num_tokens": 3,
                                                                           "prompt_lookup_min": 1})
    assert [o.token_ids for o in greedy(spec, prompts, 24)] == [o.token_ids for o in greedy(half, prompts, 24)]
    assert spec.engine.stats()["spec_accepted_tokens"] > 0


def test_kv_cache_dtype_settings(tiny_gguf):
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert pick_kv_dtype("auto", cpu, torch.float32) == torch.float32
    assert pick_kv_dtype("auto", cuda, torch.bfloat16) == torch.bfloat16
    assert pick_kv_dtype("float16", cpu, torch.float32) == torch.float16
    assert pick_kv_dtype("bfloat16", cpu, torch.float32) == torch.bfloat16
    with pytest.raises(ValueError, match="kv_cache_dtype=bfloat16 is for the CPU; on cuda the KV cache takes the "
                                         "model's dtype \\(bfloat16\\): leave kv_cache_dtype as auto"):
        pick_kv_dtype("bfloat16", cuda, torch.bfloat16)
    with pytest.raises(ValueError, match="kv_cache_dtype 'fp16' is not supported; use auto, float16, bfloat16"):
        pick_kv_dtype("fp16", cpu, torch.float32)
    with pytest.raises(ValueError, match="kv_cache_dtype 'float32' is not supported"):
        pick_kv_dtype("float32", cpu, torch.float32)
    path, reference = tiny_gguf("llama")
    with pytest.raises(ValueError, match="kv_cache_dtype=float16 is for a float32 engine; this one runs in bfloat16, "
                                         "whose KV cache is already 16-bit"):
        LLM(str(reference), dtype="bfloat16", kv_cache_dtype="float16")
