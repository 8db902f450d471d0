"""The torch reference kernels against plain dense computations and transformers' formulas."""

import math
import os
import platform
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from backend.kernels import native
from backend.kernels.attention import decode_attention, prefill_attention, store_kv, verify_attention
from backend.kernels.moe_torch import fused_moe, route
from backend.kernels.norm import add_rms_norm, rms_norm
from backend.kernels.rotary import apply_rotary, inverse_frequencies
from backend.models.mlp import silu_mul
from tests.backend.conftest import KERNEL_BUILDS, use_kernel_build


def dense_attention(q, k, v, q_positions, window=None):
    """q [S, Hq, D] at q_positions, k/v [L, Hkv, D] at 0..L-1; causal; one query row at a time."""
    hq, hkv = q.shape[1], k.shape[1]
    out = torch.empty_like(q)
    for i, pos in enumerate(q_positions):
        for h in range(hq):
            kh = k[: pos + 1, h // (hq // hkv)]
            vh = v[: pos + 1, h // (hq // hkv)]
            scores = kh @ q[i, h] / math.sqrt(q.shape[-1])
            if window is not None:
                scores[: max(0, pos + 1 - window)] = float("-inf")
            out[i, h] = torch.softmax(scores, dim=0) @ vh
    return out


@pytest.fixture(params=[*KERNEL_BUILDS, "torch"])
def impl(request, monkeypatch):
    """Decoding attention runs our C kernel on the CPU where it is built (each of its builds); the torch path is
    the fallback."""
    if request.param == "torch":
        monkeypatch.setattr(native, "usable", lambda *tensors: False)
    else:
        use_kernel_build(request.param, monkeypatch)
    return request.param


def paged(k, v, block_size, num_blocks, generator):
    """Scatter k/v [L, Hkv, D] into a cache at random blocks; return caches and the block table."""
    length = k.shape[0]
    table = torch.randperm(num_blocks, generator=generator)[: (length + block_size - 1) // block_size]
    k_cache = torch.randn(num_blocks, block_size, *k.shape[1:], generator=generator)  # garbage elsewhere
    v_cache = torch.randn(num_blocks, block_size, *k.shape[1:], generator=generator)
    slots = torch.tensor([int(table[p // block_size]) * block_size + p % block_size for p in range(length)])
    store_kv(k, v, k_cache, v_cache, slots)
    return k_cache, v_cache, table


def paged_contexts(lengths: list[int], hkv: int, d: int, bs: int, blocks: int, generator,
                   dtype: torch.dtype = torch.float32):
    """Random keys and values of each length stored at random blocks of a zeroed cache of `dtype`: the caches, the
    block tables (as lists, and padded into one tensor), and each context's keys and values as the cache holds them."""
    k_cache, v_cache = torch.zeros(blocks, bs, hkv, d, dtype=dtype), torch.zeros(blocks, bs, hkv, d, dtype=dtype)
    free = torch.randperm(blocks, generator=generator).tolist()
    tables, contexts = [], []
    for length in lengths:
        k, v = torch.randn(length, hkv, d, generator=generator), torch.randn(length, hkv, d, generator=generator)
        table = [free.pop() for _ in range((length + bs - 1) // bs)]
        store_kv(k, v, k_cache, v_cache, torch.tensor([table[p // bs] * bs + p % bs for p in range(length)]))
        tables.append(table)
        contexts.append((k.to(dtype).float(), v.to(dtype).float()))
    width = max(len(t) for t in tables)
    return k_cache, v_cache, tables, torch.tensor([t + [0] * (width - len(t)) for t in tables]), contexts


@pytest.mark.parametrize("window", [None, 5])
def test_prefill_attention_over_a_cached_prefix(window):
    g = torch.Generator().manual_seed(0)
    context, chunk, hq, hkv, d = 29, 11, 6, 2, 16
    q = torch.randn(chunk, hq, d, generator=g)
    k, v = torch.randn(context, hkv, d, generator=g), torch.randn(context, hkv, d, generator=g)
    k_cache, v_cache, table = paged(k, v, 4, 16, g)
    ours = prefill_attention(q, k_cache, v_cache, table, context, 1 / math.sqrt(d), window)
    expected = dense_attention(q, k, v, list(range(context - chunk, context)), window)
    torch.testing.assert_close(ours, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("d", [8, 64, 128])  # 64 and 128: the C kernel's unrolled value sums
@pytest.mark.parametrize("window", [None, 7])
def test_decode_attention_with_padded_block_tables(window, d, impl):
    g = torch.Generator().manual_seed(1)
    hq, hkv, bs, nb = 8, 4, 4, 32
    lengths = [1, 9, 16, 23]
    # Slots past each sequence's end hold stale (finite) values from earlier use: masking must hide them.
    k_cache = torch.randn(nb, bs, hkv, d, generator=g) * 100
    v_cache = torch.randn(nb, bs, hkv, d, generator=g) * 100
    tables, expected, qs = [], [], []
    free = torch.randperm(nb, generator=g).tolist()
    for length in lengths:
        k, v = torch.randn(length, hkv, d, generator=g), torch.randn(length, hkv, d, generator=g)
        table = [free.pop() for _ in range((length + bs - 1) // bs)]
        slots = torch.tensor([table[p // bs] * bs + p % bs for p in range(length)])
        store_kv(k, v, k_cache, v_cache, slots)
        q = torch.randn(1, hq, d, generator=g)
        qs.append(q)
        expected.append(dense_attention(q, k, v, [length - 1], window))
        tables.append(table)
    width = max(len(t) for t in tables)
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    ours = decode_attention(torch.cat(qs), k_cache, v_cache, block_tables, torch.tensor(lengths),
                            1 / math.sqrt(d), window)
    torch.testing.assert_close(ours, torch.cat(expected), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("length", [1, 6, 8, 13])
def test_decode_attention_of_equal_lengths_slices_instead_of_masking(length, impl):
    """Rows of one context length (a single sequence always) take the unmasked path: same attention."""
    g = torch.Generator().manual_seed(2)
    hq, hkv, d, bs, nb, rows = 6, 2, 8, 4, 16, 2
    k_cache = torch.randn(nb, bs, hkv, d, generator=g) * 100  # stale slots past the end must not be read
    v_cache = torch.randn(nb, bs, hkv, d, generator=g) * 100
    free = torch.randperm(nb, generator=g).tolist()
    tables, expected, qs = [], [], []
    for _ in range(rows):
        k, v = torch.randn(length, hkv, d, generator=g), torch.randn(length, hkv, d, generator=g)
        table = [free.pop() for _ in range((length + bs - 1) // bs)]
        store_kv(k, v, k_cache, v_cache, torch.tensor([table[p // bs] * bs + p % bs for p in range(length)]))
        qs.append(torch.randn(1, hq, d, generator=g))
        expected.append(dense_attention(qs[-1], k, v, [length - 1]))
        tables.append(table)
    ours = decode_attention(torch.cat(qs), k_cache, v_cache, torch.tensor(tables), torch.tensor([length] * rows),
                            1 / math.sqrt(d), uniform_len=length)
    torch.testing.assert_close(ours, torch.cat(expected), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window", [None, 5])
def test_verification_rows_attend_bit_for_bit_as_decode_rows(window, impl):
    """Rows scoring drafts give exactly what decoding those tokens one at a time gives (what greedy speculation
    needs to reproduce plain decoding), and the attention itself; a masked chunk rounds differently."""
    g = torch.Generator().manual_seed(3)
    context, chunk, hq, hkv, d, bs = 45, 6, 9, 3, 64, 16
    q = torch.randn(chunk, hq, d, generator=g)
    k, v = torch.randn(context, hkv, d, generator=g), torch.randn(context, hkv, d, generator=g)
    k_cache, v_cache, table = paged(k, v, bs, 8, g)
    table = torch.cat([table, torch.tensor([7])]) if 7 not in table else table  # a block reserved past the end
    scale = 1 / math.sqrt(d)
    ours = verify_attention(q, k_cache, v_cache, table, context, scale, window)
    for i in range(chunk):
        n = context - chunk + i + 1
        one = decode_attention(q[i:i + 1], k_cache, v_cache, table[None], torch.tensor([n]), scale, window,
                               uniform_len=n)
        assert torch.equal(ours[i:i + 1], one), i
    expected = dense_attention(q, k, v, list(range(context - chunk, context)), window)
    torch.testing.assert_close(ours, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window", [None, 300])
def test_long_contexts_attend_in_spans_merged_exactly_enough(window, impl):
    """Past 256 positions the C kernel cuts a row's context into spans of 256, one job each, merged by their top
    scores: the dense attention's result (short rows beside them keep one job), and a verification run's rows
    still get the decode rows' bits."""
    g = torch.Generator().manual_seed(4)
    hq, hkv, d, bs = 9, 3, 64, 16
    lengths = [700, 5, 257, 256, 513]
    k_cache, v_cache, tables, block_tables, contexts = paged_contexts(lengths, hkv, d, bs, 200, g)
    qs = [torch.randn(1, hq, d, generator=g) * 3 for _ in lengths]  # peaked scores: the spans' tops differ
    expected = [dense_attention(q, k, v, [n - 1], window) for q, (k, v), n in zip(qs, contexts, lengths)]
    ours = decode_attention(torch.cat(qs), k_cache, v_cache, block_tables, torch.tensor(lengths), 1 / math.sqrt(d),
                            window)
    torch.testing.assert_close(ours, torch.cat(expected), atol=1e-5, rtol=1e-5)

    chunk, table = 6, torch.tensor(tables[0])
    q = torch.randn(chunk, hq, d, generator=g)
    rows = verify_attention(q, k_cache, v_cache, table, lengths[0], 1 / math.sqrt(d), window)
    for i in range(chunk):
        n = lengths[0] - chunk + i + 1
        one = decode_attention(q[i:i + 1], k_cache, v_cache, table[None], torch.tensor([n]), 1 / math.sqrt(d),
                               window, uniform_len=n)
        assert torch.equal(rows[i:i + 1], one), i


def test_fused_moe_matches_a_per_token_loop():
    g = torch.Generator().manual_seed(2)
    t, h, i, e, k = 13, 16, 24, 6, 2
    x = torch.randn(t, h, generator=g)
    w_gate_up, w_down = torch.randn(e, 2 * i, h, generator=g), torch.randn(e, h, i, generator=g)
    weights, ids = route(torch.randn(t, e, generator=g), k, renormalize=True)
    assert torch.allclose(weights.sum(-1), torch.ones(t))
    ours = fused_moe(x, w_gate_up, w_down, weights, ids)
    expected = torch.zeros(t, h)
    for tok in range(t):
        for slot in range(k):
            ex = int(ids[tok, slot])
            gate, up = (w_gate_up[ex] @ x[tok]).chunk(2)
            expected[tok] += weights[tok, slot] * (w_down[ex] @ (torch.nn.functional.silu(gate) * up))
    torch.testing.assert_close(ours, expected, atol=1e-4, rtol=1e-5)


def test_route_without_renormalisation_keeps_softmax_weights():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    weights, ids = route(logits, 2, renormalize=False)
    probs = torch.softmax(logits, -1)[0]
    assert ids.tolist() == [[0, 1]]
    torch.testing.assert_close(weights[0], probs[:2])


@pytest.mark.parametrize("rope", [
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 8192},
    {"rope_type": "linear", "factor": 4.0},
])
def test_scaled_rope_frequencies_match_transformers(rope):
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = LlamaConfig(hidden_size=512, num_attention_heads=4, max_position_embeddings=131072,
                         rope_parameters={"rope_theta": 500000.0, **rope})
    expected, _ = ROPE_INIT_FUNCTIONS[rope["rope_type"]](config, "cpu")
    torch.testing.assert_close(inverse_frequencies(128, 500000.0, rope), expected)


needs_native = pytest.mark.skipif(native.library() is None, reason="no C compiler for the CPU kernels")


@needs_native
@pytest.mark.parametrize("rows", [1, 7])
def test_cpu_rms_norm_and_its_residual_add_match_torch(rows, c_kernels):
    """Our C kernel against PyTorch's rms_norm (the reference): the sum bit for bit, the norm to fp32 rounding."""
    g = torch.Generator().manual_seed(rows)
    x, residual, weight = (torch.randn(rows, 576, generator=g) * 3 for _ in range(3))
    weight = weight[0]
    expected = F.rms_norm(x, (576,), weight, 1e-5)
    torch.testing.assert_close(rms_norm(x, weight, 1e-5), expected, rtol=1e-6, atol=1e-5)
    out, summed = add_rms_norm(x, residual, weight, 1e-5)
    assert torch.equal(summed, x + residual)
    torch.testing.assert_close(out, F.rms_norm(x + residual, (576,), weight, 1e-5), rtol=1e-6, atol=1e-5)


@needs_native
def test_cpu_rotary_matches_rotate_half_bit_for_bit(c_kernels):
    """On q|k read as a view of the projection's output (rows wider than the heads), as the attention layer does."""
    g = torch.Generator().manual_seed(0)
    qkv = torch.randn(5, 3 * 64 + 70, generator=g)
    qk = qkv[:, :3 * 64].view(5, 3, 64)
    cos_sin = torch.randn(5, 2, 64, generator=g)
    cos, sin = cos_sin[:, 0], cos_sin[:, 1]
    rotated = torch.cat([-qk[..., 32:], qk[..., :32]], dim=-1)
    assert torch.equal(apply_rotary(qk, cos, sin), qk * cos[:, None] + rotated * sin[:, None])


@needs_native
def test_cpu_silu_mul_matches_torch(c_kernels):
    gate_up = torch.randn(3, 2 * 100, generator=torch.Generator().manual_seed(1)) * 4
    torch.testing.assert_close(silu_mul(gate_up), F.silu(gate_up[:, :100]) * gate_up[:, 100:], rtol=1e-6, atol=1e-6)


@pytest.mark.skipif(platform.machine() != "x86_64" or native.library() is None,
                    reason="the -march names below are x86's; needs a C compiler")
def test_the_kernels_build_for_the_cpu_named_in_scriptorium_cpu_march():
    """SCRIPTORIUM_CPU_MARCH=x86-64 builds the portable vectors (tiles of 4 rows, no VNNI) on any x86 CPU; a name the
    compiler does not know leaves the kernels off with one warning saying why, not a crash."""
    probe = ("import logging; logging.basicConfig(); from backend.kernels import native; "
             "print(native.library() is not None and (native.tile_rows(), native.vnni()))")

    def run(march: str) -> subprocess.CompletedProcess:
        env = {**os.environ, "SCRIPTORIUM_CPU_MARCH": march}
        return subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=600)

    portable = run("x86-64")
    assert portable.stdout.strip() == "(4, False)", portable.stderr
    unknown = run("no-such-cpu")
    assert unknown.stdout.strip() == "False"
    assert "no CPU kernels" in unknown.stderr and "no-such-cpu" in unknown.stderr
