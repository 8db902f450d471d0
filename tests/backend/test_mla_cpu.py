"""Latent attention's decode rows in our C kernel (backend/csrc/cpu_mla.c) against the torch path: W_UK and W_UV as
int8 blocks where kv_b holds them exactly (a GGUF's Q8_0 attn_k_b / attn_v_b as gguf-py decodes them) and as fp32
otherwise, over fp32 and bf16 latent caches, rows of other lengths over shuffled blocks, and a verification run's
rows sharing one table (stride 0)."""

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize, quantize

from backend.kernels import native
from backend.kernels.mla_attention import HeadWeights, absorbed_attention, exact_int8

pytestmark = pytest.mark.skipif(not native.enabled(), reason="needs our C kernels (a C compiler)")

HEADS, NOPE, ROPE, V, LORA, BLOCK = 4, 32, 16, 64, 96, 4


def q8_0(w: np.ndarray) -> torch.Tensor:
    """w as a Q8_0 tensor of it decodes (blocks of 32 along the last axis)."""
    return torch.from_numpy(dequantize(quantize(w, T.Q8_0), T.Q8_0).reshape(w.shape).astype(np.float32))


def kv_b_of_q8_0_halves(rng: np.random.Generator) -> torch.Tensor:
    """kv_b [heads * (nope + v), lora] joined from Q8_0 attn_k_b [heads, lora, nope] and attn_v_b [heads, v, lora],
    as the GGUF loader joins llama.cpp's split layout."""
    k_b = q8_0(rng.standard_normal((HEADS, LORA, NOPE)).astype(np.float32) * 0.2)
    v_b = q8_0(rng.standard_normal((HEADS, V, LORA)).astype(np.float32) * 0.2)
    return torch.cat([k_b.transpose(1, 2), v_b], dim=1).reshape(-1, LORA).contiguous()


def rows(n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(n, HEADS, NOPE + ROPE, generator=g)
    return q[..., :NOPE], q[..., NOPE:]  # views with a row stride of nope + rope, as the model slices them


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("weights", ["q8_0", "fp32"])
def test_the_c_rows_are_the_torch_rows(weights, kv_dtype):
    rng = np.random.default_rng(1)
    if weights == "q8_0":
        w_kv_b = kv_b_of_q8_0_halves(rng)
    else:
        w_kv_b = torch.from_numpy(rng.standard_normal((HEADS * (NOPE + V), LORA)).astype(np.float32) * 0.2)
    cache = torch.randn(12, BLOCK, 1, LORA + ROPE, generator=torch.Generator().manual_seed(2)).to(kv_dtype)
    tables = torch.tensor([[5, 2, 0, 3, 11, 7, 9], [8, 4, 6, 0, 0, 0, 0], [1, 0, 0, 0, 0, 0, 0]])
    lens = torch.tensor([27, 10, 1])
    q_nope, q_pe = rows(3)
    held = HeadWeights()
    ours = absorbed_attention(q_nope, q_pe, cache, w_kv_b, tables, lens, 0.3, held)
    assert held.source == w_kv_b.data_ptr()  # the C kernel ran, with the weights it was given
    # int8 where the halves were Q8_0 (exactly their values), fp32 where no int8 blocks are exact
    expected_kind = torch.int8 if weights == "q8_0" else torch.float32
    assert held.uk.dtype == held.uv.dtype == expected_kind
    reference = absorbed_attention(q_nope, q_pe, cache, w_kv_b, tables, lens, 0.3)
    torch.testing.assert_close(ours, reference, atol=2e-5, rtol=1e-5)


def test_a_verification_runs_rows_share_one_table():
    """Rows at consecutive positions of one sequence (the table expanded: stride 0), as a draft's verification or
    a short prompt chunk attends."""
    w_kv_b = kv_b_of_q8_0_halves(np.random.default_rng(3))
    cache = torch.randn(10, BLOCK, 1, LORA + ROPE, generator=torch.Generator().manual_seed(4))
    table = torch.tensor([7, 1, 4, 9, 2])
    lens = torch.arange(14, 19)
    q_nope, q_pe = rows(5, seed=5)
    ours = absorbed_attention(q_nope, q_pe, cache, w_kv_b, table.expand(5, -1), lens, 0.25, HeadWeights())
    reference = absorbed_attention(q_nope, q_pe, cache, w_kv_b, table.expand(5, -1), lens, 0.25)
    torch.testing.assert_close(ours, reference, atol=2e-5, rtol=1e-5)


def test_int8_blocks_are_taken_only_where_they_are_exact():
    w = q8_0(np.random.default_rng(6).standard_normal((8, 64)).astype(np.float32))
    codes, scales = exact_int8(w)
    assert codes.dtype == torch.int8 and scales.shape == (8, 2)
    assert torch.equal(codes.float().unflatten(-1, (2, 32)) * scales[..., None], w.unflatten(-1, (2, 32)))
    w[3, 5] += 1e-3  # one element off its block's grid
    same, none = exact_int8(w)
    assert none is None and same is w
    zeros, zero_scales = exact_int8(torch.zeros(2, 32))  # an all-zero block: scale 0, exact
    assert not zeros.any() and not zero_scales.any()


def test_the_weights_are_made_again_when_kv_b_moves():
    rng = np.random.default_rng(7)
    first, second = kv_b_of_q8_0_halves(rng), kv_b_of_q8_0_halves(rng)
    held = HeadWeights()
    cache = torch.randn(4, BLOCK, 1, LORA + ROPE)
    tables, lens = torch.tensor([[0, 1, 2, 3]]), torch.tensor([13])
    q_nope, q_pe = rows(1, seed=8)
    absorbed_attention(q_nope, q_pe, cache, first, tables, lens, 0.3, held)
    ours = absorbed_attention(q_nope, q_pe, cache, second, tables, lens, 0.3, held)
    torch.testing.assert_close(ours, absorbed_attention(q_nope, q_pe, cache, second, tables, lens, 0.3))
