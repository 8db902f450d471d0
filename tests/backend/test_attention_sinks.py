"""Attention sinks (gpt-oss: one learned logit a query head that joins every softmax's denominator and weighs no
value) in each attention path: the torch reference, our C kernel (its builds), and the Triton kernels
(interpreted on the CPU), all against a plain softmax over [scores, sink]."""

import math

import pytest
import torch

from backend.kernels.attention import decode_attention, prefill_attention, verify_attention
from tests.backend.conftest import on_kernel_device
from tests.backend.test_kernels import impl, paged_contexts  # noqa: F401 (impl: a fixture)


def with_sinks(q, k, v, q_positions, sinks, window=None):
    """q [S, Hq, D] at q_positions, k/v [L, Hkv, D] at 0..L-1; causal; softmax over [scores, sink] a row."""
    hq, hkv = q.shape[1], k.shape[1]
    out = torch.empty_like(q)
    for i, pos in enumerate(q_positions):
        lo = 0 if window is None else max(0, pos + 1 - window)
        for h in range(hq):
            kh, vh = k[lo : pos + 1, h // (hq // hkv)], v[lo : pos + 1, h // (hq // hkv)]
            scores = kh @ q[i, h] / math.sqrt(q.shape[-1])
            probs = torch.softmax(torch.cat([scores, sinks[h : h + 1]]), dim=0)
            out[i, h] = probs[:-1] @ vh
    return out


def sinks_of(hq: int, g: torch.Generator) -> torch.Tensor:
    """Sinks around the scores' size, one far above them (that head's output nearly zero) and one far below."""
    sinks = torch.randn(hq, generator=g) * 2
    sinks[0], sinks[-1] = 30.0, -30.0
    return sinks


@pytest.mark.parametrize("window", [None, 5, 300])
def test_decode_rows_count_the_sink_in_every_softmax(window, impl):  # noqa: F811
    """Short rows (one job each in the C kernel) and rows past 256 positions (spans merged, the sink added once at
    the merge), batched; GQA groups of 3."""
    g = torch.Generator().manual_seed(10)
    hq, hkv, d, bs = 9, 3, 64, 16
    lengths = [1, 9, 23, 700, 257]
    k_cache, v_cache, _, block_tables, contexts = paged_contexts(lengths, hkv, d, bs, 120, g)
    qs = [torch.randn(1, hq, d, generator=g) * 2 for _ in lengths]
    sinks = sinks_of(hq, g)
    expected = [with_sinks(q, k, v, [n - 1], sinks, window) for q, (k, v), n in zip(qs, contexts, lengths)]
    ours = decode_attention(
        torch.cat(qs),
        k_cache,
        v_cache,
        block_tables,
        torch.tensor(lengths),
        1 / math.sqrt(d),
        window,
        sinks=sinks,
    )
    torch.testing.assert_close(ours, torch.cat(expected), atol=1e-5, rtol=1e-5)
    assert ours[:, 0].abs().max() < 1e-6  # the sink took (nearly) all of head 0's weight


@pytest.mark.parametrize("window", [None, 7])
def test_verification_rows_with_sinks_are_the_decode_rows(window, impl):  # noqa: F811
    g = torch.Generator().manual_seed(11)
    context, chunk, hq, hkv, d, bs = 45, 6, 4, 2, 64, 16
    k_cache, v_cache, tables, _, [(k, v)] = paged_contexts([context], hkv, d, bs, 8, g)
    table = torch.tensor(tables[0])
    q = torch.randn(chunk, hq, d, generator=g)
    sinks = sinks_of(hq, g)
    scale = 1 / math.sqrt(d)
    ours = verify_attention(q, k_cache, v_cache, table, context, scale, window, sinks)
    for i in range(chunk):
        n = context - chunk + i + 1
        one = decode_attention(
            q[i : i + 1],
            k_cache,
            v_cache,
            table[None],
            torch.tensor([n]),
            scale,
            window,
            uniform_len=n,
            sinks=sinks,
        )
        assert torch.equal(ours[i : i + 1], one), i
    positions = list(range(context - chunk, context))
    torch.testing.assert_close(ours, with_sinks(q, k, v, positions, sinks, window), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize("context,chunk", [(20, 20), (45, 13)])  # a whole prompt; a cached prefix + a chunk
def test_prefill_chunks_count_the_sink(window, context, chunk):
    g = torch.Generator().manual_seed(12)
    hq, hkv, d, bs = 4, 2, 16, 8
    k_cache, v_cache, tables, _, [(k, v)] = paged_contexts([context], hkv, d, bs, 10, g)
    q = torch.randn(chunk, hq, d, generator=g)
    sinks = sinks_of(hq, g)
    ours = prefill_attention(
        q, k_cache, v_cache, torch.tensor(tables[0]), context, 1 / math.sqrt(d), window, sinks
    )
    expected = with_sinks(q, k, v, list(range(context - chunk, context)), sinks, window)
    torch.testing.assert_close(ours, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window", [None, 5, 90])
def test_triton_kernels_count_the_sink(window):
    """The CUDA path's decode and prefill kernels (fp32, interpreted where there is no GPU)."""
    pytest.importorskip("triton")
    from backend.kernels import triton_kernels as tk

    g = torch.Generator().manual_seed(13)
    hq, hkv, d, bs = 6, 2, 16, 16
    contexts, chunks = [1, 20, 150, 45], [1, 20, 130, 13]
    k_cache, v_cache, _, block_tables, kv = paged_contexts(contexts, hkv, d, bs, 40, g)
    sinks = sinks_of(hq, g)
    lens = torch.tensor(contexts)
    q = torch.randn(len(contexts), hq, d, generator=g)
    ours = on_kernel_device(tk.decode_attention, q, k_cache, v_cache, block_tables, lens, 0.25, window, sinks)
    for i, ((k, v), n) in enumerate(zip(kv, contexts)):
        expected = with_sinks(q[i : i + 1] * 0.25 * math.sqrt(d), k, v, [n - 1], sinks, window)
        torch.testing.assert_close(ours[i : i + 1], expected, atol=1e-5, rtol=1e-5)
    q = torch.randn(sum(chunks), hq, d, generator=g)
    cu = torch.tensor([0, *torch.cumsum(torch.tensor(chunks), 0).tolist()])
    ours = on_kernel_device(
        tk.prefill_attention,
        q,
        k_cache,
        v_cache,
        block_tables,
        cu,
        lens,
        max(chunks),
        1 / math.sqrt(d),
        window,
        sinks,
    )
    for i, ((k, v), n) in enumerate(zip(kv, contexts)):
        rows = slice(int(cu[i]), int(cu[i + 1]))
        expected = with_sinks(q[rows], k, v, list(range(n - chunks[i], n)), sinks, window)
        torch.testing.assert_close(ours[rows], expected, atol=1e-5, rtol=1e-5)
