"""Every Triton kernel against its torch reference: compiled on a GPU, or on the CPU through Triton's
interpreter (tests/conftest.py turns it on where there is no GPU). The references run on the CPU."""

import math

import pytest
import torch

pytest.importorskip("triton")

from backend.kernels import attention, moe_torch, norm, rotary  # noqa: E402
from backend.kernels import moe_triton as mt  # noqa: E402
from backend.kernels import triton_kernels as tk  # noqa: E402
from tests.backend.conftest import KERNEL_DEVICE, interpreted_only, on_kernel_device  # noqa: E402

G = torch.Generator().manual_seed(0)


def rand(*shape):
    return torch.randn(*shape, generator=G)


def paged_cache(lengths, hkv, d, bs, num_blocks):
    """Random K/V for sequences of these lengths scattered into random blocks; returns caches, tables, k/v."""
    k_cache, v_cache = rand(num_blocks, bs, hkv, d) * 50, rand(num_blocks, bs, hkv, d) * 50  # stale garbage
    free = torch.randperm(num_blocks, generator=G).tolist()
    tables, kv = [], []
    for length in lengths:
        table = [free.pop() for _ in range(max(1, math.ceil(length / bs)))]
        k, v = rand(length, hkv, d), rand(length, hkv, d)
        slots = torch.tensor([table[p // bs] * bs + p % bs for p in range(length)], dtype=torch.long)
        attention.store_kv(k, v, k_cache, v_cache, slots)
        tables.append(table)
        kv.append((k, v))
    width = max(len(t) for t in tables)
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.long)
    return k_cache, v_cache, block_tables, kv


def test_store_kv_matches_and_skips_padding_slots():
    k, v = rand(7, 2, 8), rand(7, 2, 8)
    slots = torch.tensor([3, 17, 0, -1, 9, 30, 5])
    expected_k, expected_v = torch.zeros(4, 8, 2, 8), torch.zeros(4, 8, 2, 8)
    keep = slots >= 0
    attention.store_kv(k[keep], v[keep], expected_k, expected_v, slots[keep])
    k_cache, v_cache = torch.zeros(4, 8, 2, 8, device=KERNEL_DEVICE), torch.zeros(4, 8, 2, 8, device=KERNEL_DEVICE)
    tk.store_kv(*(t.to(KERNEL_DEVICE) for t in (k, v)), k_cache, v_cache, slots.to(KERNEL_DEVICE))
    assert torch.equal(k_cache.cpu(), expected_k) and torch.equal(v_cache.cpu(), expected_v)


@pytest.mark.parametrize("hq,hkv,d,window", [(8, 2, 16, None), (4, 4, 24, None), (6, 3, 16, 5), (9, 3, 16, 70)])
def test_decode_attention(hq, hkv, d, window):
    # One token; not a multiple of the block; exactly one block; several blocks; several 64-token tiles.
    # Groups of 4, 1, 2 and 3 query heads per kv head; windows inside one tile and across tiles.
    lengths = [1, 7, 16, 33, 150]
    k_cache, v_cache, tables, _ = paged_cache(lengths, hkv, d, 16, 40)
    q = rand(len(lengths), hq, d)
    lens = torch.tensor(lengths)
    expected = attention.decode_attention(q, k_cache, v_cache, tables, lens, 0.25, window)
    ours = on_kernel_device(tk.decode_attention, q, k_cache, v_cache, tables, lens, 0.25, window)
    torch.testing.assert_close(ours, expected, atol=1e-5, rtol=1e-5)


def test_decode_attention_padding_row_is_zero():
    k_cache, v_cache, tables, _ = paged_cache([5], 2, 16, 16, 4)
    out = on_kernel_device(tk.decode_attention, rand(1, 4, 16), k_cache, v_cache, tables, torch.tensor([0]), 0.25)
    assert torch.equal(out, torch.zeros_like(out))


@pytest.mark.parametrize("bs", [128, 256])
def test_attention_over_blocks_larger_than_a_tile(bs):
    """A cache block wider than the kernels' 64-token tile: a tile reads part of one block, as on a 4090 with
    block_size 256 (the tile stays small so shared memory does not grow with the block)."""
    assert bs > tk.KV_TILE
    hq, hkv, d, contexts, chunks = 4, 2, 16, [1, 70, 300], [1, 70, 45]
    k_cache, v_cache, tables, _ = paged_cache(contexts, hkv, d, bs, 8)
    lens = torch.tensor(contexts)
    q = rand(len(contexts), hq, d)
    torch.testing.assert_close(on_kernel_device(tk.decode_attention, q, k_cache, v_cache, tables, lens, 0.25),
                               attention.decode_attention(q, k_cache, v_cache, tables, lens, 0.25), atol=1e-5, rtol=1e-5)
    q = rand(sum(chunks), hq, d)
    cu = torch.tensor([0] + list(torch.cumsum(torch.tensor(chunks), 0)))
    ours = on_kernel_device(tk.prefill_attention, q, k_cache, v_cache, tables, cu, lens, max(chunks), 0.3)
    for i, ctx in enumerate(contexts):
        expected = attention.prefill_attention(q[cu[i]:cu[i + 1]], k_cache, v_cache, tables[i], ctx, 0.3)
        torch.testing.assert_close(ours[cu[i]:cu[i + 1]], expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window", [None, 7, 90])
@pytest.mark.parametrize("contexts,chunks", [
    ([1, 20, 45, 16], [1, 20, 13, 3]),  # one token; a whole prompt; a cached prefix + a chunk; a short chunk
    ([150, 200, 70], [130, 70, 70]),  # several query tiles and 64-token key tiles, a prefix + chunk among them
])
def test_prefill_attention_over_cached_prefixes(window, contexts, chunks):
    hq, hkv, d, bs = 4, 2, 16, 16
    k_cache, v_cache, tables, _ = paged_cache(contexts, hkv, d, bs, 40)
    q = rand(sum(chunks), hq, d)
    cu = torch.tensor([0] + list(torch.cumsum(torch.tensor(chunks), 0)))
    ours = on_kernel_device(tk.prefill_attention, q, k_cache, v_cache, tables, cu, torch.tensor(contexts),
                            max(chunks), 0.3, window)
    for i, ctx in enumerate(contexts):
        expected = attention.prefill_attention(q[cu[i]:cu[i + 1]], k_cache, v_cache, tables[i], ctx, 0.3, window)
        torch.testing.assert_close(ours[cu[i]:cu[i + 1]], expected, atol=1e-5, rtol=1e-5)


def test_rms_norm_with_and_without_residual():
    x, res, w = rand(5, 48), rand(5, 48), rand(48)
    torch.testing.assert_close(on_kernel_device(tk.rms_norm, x, w, 1e-6), norm.rms_norm(x, w, 1e-6),
                               atol=1e-5, rtol=1e-5)
    out, summed = on_kernel_device(tk.rms_norm, x, w, 1e-6, residual=res)
    expected_out, expected_sum = norm.add_rms_norm(x, res, w, 1e-6)
    torch.testing.assert_close(out, expected_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(summed, expected_sum)


def test_rotary():
    table = rotary.cos_sin_table(24, 10000.0, None, 64)
    positions = torch.tensor([0, 3, 17, 63, 5])
    cos, sin = table[positions, 0], table[positions, 1]
    x = rand(5, 3, 24)
    torch.testing.assert_close(on_kernel_device(tk.apply_rotary, x, cos, sin), rotary.apply_rotary(x, cos, sin),
                               atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("tokens,experts,top_k,hidden,inter", [(9, 6, 2, 40, 24), (1, 4, 2, 32, 16), (33, 8, 3, 48, 40)])
def test_fused_moe(tokens, experts, top_k, hidden, inter):
    x = rand(tokens, hidden)
    w_gate_up, w_down = rand(experts, 2 * inter, hidden) / 4, rand(experts, hidden, inter) / 4
    logits = rand(tokens, experts)
    logits[:, 0] = -1e9  # expert 0 receives no tokens
    weights, ids = moe_torch.route(logits, top_k, renormalize=True)
    expected = moe_torch.fused_moe(x, w_gate_up, w_down, weights, ids)
    torch.testing.assert_close(on_kernel_device(mt.fused_moe, x, w_gate_up, w_down, weights, ids), expected,
                               atol=1e-4, rtol=1e-4)


def test_align_by_expert_pads_each_expert_to_whole_blocks():
    ids = torch.tensor([[2, 0], [2, 3], [0, 2]])
    pairs, experts, used = on_kernel_device(mt.align_by_expert, ids, 5, 4)
    assert used.tolist() == [3] and experts[:3].tolist() == [0, 2, 3]  # experts 1 and 4 get no block
    assert pairs[:12].view(-1, 4).tolist() == [[1, 4, -1, -1], [0, 2, 5, -1], [3, -1, -1, -1]]
    # Sized from the shape alone (6 pairs + 5 experts * 3 rows of padding, in whole blocks): no device sync.
    assert pairs.numel() == 24 and experts.numel() == 6 and bool((pairs[12:] == -1).all())


@pytest.mark.parametrize("tiles", [(16, 32, 128), (64, 64, 64)])
def test_fused_moe_tile_shapes(tiles):
    """Both tile configurations, each with lengths that are not multiples of the tiles."""
    x, w_gate_up, w_down = rand(21, 72), rand(6, 2 * 40, 72) / 4, rand(6, 72, 40) / 4
    weights, ids = moe_torch.route(rand(21, 6), 2, renormalize=False)
    expected = moe_torch.fused_moe(x, w_gate_up, w_down, weights, ids)
    torch.testing.assert_close(on_kernel_device(mt.fused_moe, x, w_gate_up, w_down, weights, ids, tiles=tiles),
                               expected,
                               atol=1e-4, rtol=1e-4)


@interpreted_only
@pytest.mark.parametrize("family", ["qwen3", "mixtral", "mistral"])
def test_a_whole_model_on_the_triton_path_matches_the_torch_path(family, tiny_dir, monkeypatch):
    """The CUDA path (batch tensors, mixed decode + chunked prefill, every kernel) run through the interpreter."""
    from backend import LLM, SamplingParams
    from tests.backend.conftest import prompts_of_lengths

    prompts = prompts_of_lengths(3, 21, 30)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in
                LLM(str(tiny_dir(family)), block_size=16).generate(prompts, params, use_tqdm=False)]
    monkeypatch.setenv("SCRIPTORIUM_TRITON", "1")
    llm = LLM(str(tiny_dir(family)), block_size=16, max_num_batched_tokens=24)  # chunks prompts beside decodes
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == expected


# Half precision, on a GPU only: Triton's interpreter multiplies bf16 wrongly. The kernels take inputs rounded to
# the dtype and the fp32 references take the same rounded values, so what differs is the kernels' own rounding:
# the output (half a unit in the last place: 2**-8 of the value in bf16, 2**-11 in fp16) and, in attention and
# the MoE, one intermediate rounded to the dtype before a second product (as much again). Twice their sum:
HALF_TOLERANCE = {torch.bfloat16: 2 ** -6, torch.float16: 2 ** -9}
needs_gpu = pytest.mark.skipif(KERNEL_DEVICE.type != "cuda", reason="half precision is checked on a GPU")


def assert_half_close(ours: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    tol = HALF_TOLERANCE[dtype]
    torch.testing.assert_close(ours.float(), expected, atol=tol * expected.abs().max().item(), rtol=tol)


@needs_gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_attention_against_fp32(dtype):
    contexts, chunks, hq, hkv, d = [1, 45, 200], [1, 13, 70], 8, 2, 64
    k_cache, v_cache, tables, _ = paged_cache(contexts, hkv, d, 16, 40)
    k_cache, v_cache = k_cache.to(dtype), v_cache.to(dtype)
    lens = torch.tensor(contexts)
    q = rand(len(contexts), hq, d).to(dtype)
    expected = attention.decode_attention(q.float(), k_cache.float(), v_cache.float(), tables, lens, 0.125)
    assert_half_close(on_kernel_device(tk.decode_attention, q, k_cache, v_cache, tables, lens, 0.125), expected, dtype)
    q = rand(sum(chunks), hq, d).to(dtype)
    cu = torch.tensor([0] + list(torch.cumsum(torch.tensor(chunks), 0)))
    ours = on_kernel_device(tk.prefill_attention, q, k_cache, v_cache, tables, cu, lens, max(chunks), 0.125)
    for i, ctx in enumerate(contexts):
        expected = attention.prefill_attention(q[cu[i]:cu[i + 1]].float(), k_cache.float(), v_cache.float(),
                                               tables[i], ctx, 0.125)
        assert_half_close(ours[cu[i]:cu[i + 1]], expected, dtype)


@needs_gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_norm_rotary_and_moe_against_fp32(dtype):
    x, res, w = (t.to(dtype) for t in (rand(5, 576), rand(5, 576), rand(576)))
    assert_half_close(on_kernel_device(tk.rms_norm, x, w, 1e-6), norm.rms_norm(x.float(), w.float(), 1e-6), dtype)
    out, summed = on_kernel_device(tk.rms_norm, x, w, 1e-6, residual=res)
    expected_out, expected_sum = norm.add_rms_norm(x.float(), res.float(), w.float(), 1e-6)
    assert_half_close(summed, expected_sum, dtype)
    # The kernel normalises the sum it rounded to the dtype, as the model's next layer reads it.
    assert_half_close(out, norm.rms_norm(summed.float(), w.float(), 1e-6), dtype)
    table = rotary.cos_sin_table(64, 10000.0, None, 64)
    positions = torch.tensor([0, 3, 17, 63, 5])
    cos, sin = table[positions, 0].to(dtype), table[positions, 1].to(dtype)
    x = rand(5, 3, 64).to(dtype)
    assert_half_close(on_kernel_device(tk.apply_rotary, x, cos, sin),
                      rotary.apply_rotary(x.float(), cos.float(), sin.float()), dtype)
    x = rand(33, 256).to(dtype)
    w_gate_up, w_down = (rand(8, 2 * 128, 256) / 16).to(dtype), (rand(8, 256, 128) / 16).to(dtype)
    weights, ids = moe_torch.route(rand(33, 8), 2, renormalize=True)
    expected = moe_torch.fused_moe(x.float(), w_gate_up.float(), w_down.float(), weights, ids)
    assert_half_close(on_kernel_device(mt.fused_moe, x, w_gate_up, w_down, weights, ids), expected, dtype)
