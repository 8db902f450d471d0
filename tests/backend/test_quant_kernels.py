"""Every GGUF format we compute on: the torch decoder, the Triton kernels (interpreter) and the CPU int4 repack
against gguf-py's dequantize + a float matmul, on random blocks, odd shapes, one row of x and several."""

import numpy as np
import pytest
import torch

from backend.kernels import quant_triton
from backend.quant import cpu_pack
from backend.quant.formats import BY_NAME, dequantize, row_bytes
from backend.quant.modules import QuantWeight
from tests.backend.quant_blocks import SCALE_FIELDS, gguf_dequant, random_raw

FORMATS = list(BY_NAME)
ROWS = 37  # odd, not a multiple of any tile or of the CPU kernel's 16


def cols_of(name: str) -> int:
    return 3 * BY_NAME[name].block  # three blocks a row: tiles straddle block edges


def triton_matmul(x, raw, name):
    fmt = BY_NAME[name]
    cols = x.shape[1]
    return quant_triton.qlinear(x, raw, fmt.ggml_type, raw.shape[0], cols, row_bytes(fmt, cols))


def cpu_matmul(x, raw, name):
    packed, sz, planes = cpu_pack.pack(raw, BY_NAME[name], x.shape[1])
    return cpu_pack.matmul(x, packed, sz, planes, raw.shape[0])


def assert_exact(y, ref):
    """fp32 matmuls that differ only in summation order."""
    torch.testing.assert_close(y, ref, atol=1e-5 * ref.abs().max().item(), rtol=1e-4)


def assert_bf16(y, ref):
    """bf16 activations, scales and outputs (relative 2**-9 each): 1% of the output's norm, row by row."""
    err = ((y - ref).norm(dim=-1) / ref.norm(dim=-1)).max().item()
    assert err < 1e-2, f"relative error {err:.2e}"


@pytest.mark.parametrize("name", FORMATS)
def test_torch_decoder_is_bit_exact_to_gguf(name):
    raw = random_raw(name, ROWS, 2 * BY_NAME[name].block, seed=1, lead=(2,))
    ours = dequantize(torch.from_numpy(raw), BY_NAME[name], 2 * BY_NAME[name].block)
    assert torch.equal(ours, gguf_dequant(raw, name))


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("m", [1, 3, 9])
def test_triton_kernels_match_dequantize_and_matmul(name, m):
    """m <= 4 runs the GEMV-shaped kernel, 9 the tiled GEMM."""
    cols = cols_of(name)
    raw = random_raw(name, ROWS, cols, seed=2)
    x = torch.randn(m, cols, generator=torch.Generator().manual_seed(m))
    ref = x @ gguf_dequant(raw, name).T
    assert_exact(triton_matmul(x, torch.from_numpy(raw), name), ref)


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("m", [1, 5])
def test_cpu_int4_repack_matches_dequantize_and_matmul(name, m):
    cols = cols_of(name)
    raw = random_raw(name, ROWS, cols, seed=3)
    x = torch.randn(m, cols, generator=torch.Generator().manual_seed(m))
    assert_bf16(cpu_matmul(x, torch.from_numpy(raw), name), x @ gguf_dequant(raw, name).T)


@pytest.mark.parametrize("name", FORMATS)
def test_cpu_dense_expansion_for_many_rows_matches_dequantize_and_matmul(name):
    """From DENSE_ROWS rows the packed weight is expanded and multiplied in fp32: its weights are the kernel's
    (bf16 scales, the only rounding left), over a full block of 32 packed rows and a last one of 16."""
    assert cpu_pack.dense_layout_ok()
    cols = cols_of(name)
    raw = random_raw(name, ROWS, cols, seed=6)
    packed, sz, planes = cpu_pack.pack(torch.from_numpy(raw), BY_NAME[name], cols)
    w = gguf_dequant(raw, name)
    expanded = cpu_pack.expand(packed.reshape(-1), sz, planes, cols)
    assert expanded.shape == (48, cols) and not expanded[ROWS:].any()  # padding rows weigh zero
    assert_bf16(expanded[:ROWS], w)  # row by row: a row or column out of place would be off by ~100%
    x = torch.randn(cpu_pack.DENSE_ROWS + 3, cols, generator=torch.Generator().manual_seed(6))
    y = cpu_pack.matmul(x, packed, sz, planes, ROWS)
    torch.testing.assert_close(y, x @ expanded[:ROWS].T)  # the dense path, not the kernel's bf16 one
    assert_bf16(y, x @ w.T)


@pytest.mark.parametrize("name", ["Q2_K", "Q3_K", "Q6_K"])
def test_16_weight_groups_requantized_for_the_cpu_add_under_half_a_step(name):
    """The only inexact repack: 8 bits per group of 32, at most half of 1/127 of the group's largest weight."""
    cols = cols_of(name)
    raw = random_raw(name, ROWS, cols, seed=4)
    w = gguf_dequant(raw, name).view(ROWS, -1, 32)
    q, scale, _ = cpu_pack._int8_groups(torch.from_numpy(raw), BY_NAME[name], cols)
    err = (q.float() * scale[..., None] - w).abs()
    assert (err <= scale[..., None] / 2 + 1e-7).all()


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the swapped bytes may read as inf or nan
@pytest.mark.parametrize("name", FORMATS)
def test_a_wrong_scale_offset_fails_the_checks(name):
    """Reading a block's fp16 scale two bytes off (here: the bytes swapped in the data) must not pass."""
    cols = cols_of(name)
    raw = random_raw(name, ROWS, cols, seed=5)
    x = torch.randn(3, cols, generator=torch.Generator().manual_seed(5))
    ref = x @ gguf_dequant(raw, name).T
    fmt = BY_NAME[name]
    blocks = raw.reshape(ROWS, -1, fmt.block_bytes).copy()
    at = SCALE_FIELDS[name][0]
    near = at + 2 if at + 4 <= fmt.block_bytes else at - 2
    blocks[..., [at, at + 1, near, near + 1]] = blocks[..., [near, near + 1, at, at + 1]]
    wrong = torch.from_numpy(np.ascontiguousarray(blocks.reshape(ROWS, -1)))
    with pytest.raises(AssertionError):
        assert_exact(triton_matmul(x, wrong, name), ref)
    with pytest.raises(AssertionError):
        assert_bf16(cpu_matmul(x, wrong, name), ref)


def test_quant_weight_paths_agree_on_an_expert_stack():
    """QuantWeight.matmul: the reference, Triton and CPU-repacked paths on expert 1 of a stack of 3."""
    name, cols = "Q4_K", 512
    raw = torch.from_numpy(random_raw(name, ROWS, cols, seed=6, lead=(3,)))
    w = QuantWeight(BY_NAME[name], ROWS, cols, lead=(3,), device="cpu")
    w.data.copy_(raw)
    x = torch.randn(4, cols)
    ref = x @ gguf_dequant(raw[1].numpy(), name).T
    assert_exact(w.matmul(x, expert=1), ref)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SCRIPTORIUM_TRITON", "1")
        assert_exact(w.matmul(x, expert=1), ref)
    w.pack_for_cpu()
    assert w.data is None and w.packed.shape[0] == 3
    assert_bf16(w.matmul(x, expert=1), ref)


def test_float_parts_and_the_dense_code_path():
    """A fused layer may mix formats and floats; format 0 is a plain matrix in the kernels."""
    x = torch.randn(6, 64)
    w = torch.randn(20, 64)
    assert_exact(quant_triton.qlinear(x, w, 0, 20, 64, 0), x @ w.T)
    assert_exact(quant_triton.qlinear(x[:2], w, 0, 20, 64, 0), x[:2] @ w.T)
