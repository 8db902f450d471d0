"""Every GGUF format we compute on: the torch decoder, the Triton kernels (interpreter) and the CPU kernel
against gguf-py's dequantize + a float matmul, on random blocks, odd shapes, one row of x and several."""

import numpy as np
import pytest
import torch

from backend.kernels import moe_torch, native, quant_gemv_triton, quant_moe_triton, quant_triton
from backend.quant import cpu_layout
from backend.quant.formats import BY_NAME, dequantize, row_bytes
from backend.quant.modules import QuantWeight
from tests.backend.conftest import KERNEL_DEVICE, fp32_order, interpreted_only, on_kernel_device
from tests.backend.quant_blocks import SCALE_FIELDS, gguf_dequant, random_raw

FORMATS = list(BY_NAME)
ROWS = 101  # odd: six panels of 16 weight rows and a part (the CPU kernel's tiles take 1, 2 or 4 panels)


def cols_of(name: str) -> int:
    return 3 * BY_NAME[name].block  # three blocks a row: tiles straddle block edges


def triton_matmul(x, raw, name):
    fmt = BY_NAME[name]
    cols = x.shape[1]
    return on_kernel_device(quant_triton.qlinear, x, raw, fmt.ggml_type, raw.shape[0], cols, row_bytes(fmt, cols))


def cpu_matmul(x, raw, name):
    codes, scales, offsets, layout = cpu_layout.pack(raw, BY_NAME[name], x.shape[1])
    return cpu_layout.matmul(x, codes, scales, offsets, layout, raw.shape[0])


def assert_exact(y, ref):
    """fp32 matmuls that differ only in summation order."""
    torch.testing.assert_close(y, ref, atol=1e-5 * ref.abs().max().item(), rtol=1e-4)


@pytest.mark.parametrize("name", FORMATS)
def test_torch_decoder_is_bit_exact_to_gguf(name):
    raw = random_raw(name, ROWS, 2 * BY_NAME[name].block, seed=1, lead=(2,))
    ours = dequantize(torch.from_numpy(raw), BY_NAME[name], 2 * BY_NAME[name].block)
    assert torch.equal(ours, gguf_dequant(raw, name))


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("m", [1, 3, 9, 67])
def test_triton_kernels_match_dequantize_and_matmul(name, m):
    """m <= 4 runs the GEMV-shaped kernel, 9 the block-wise product (the per-weight tiled GEMM for formats it does
    not read), 67 the per-weight tiled GEMM (the block-wise product still for the codebooks, which it alone reads)."""
    cols = cols_of(name)
    raw = random_raw(name, ROWS, cols, seed=2)
    x = torch.randn(m, cols, generator=torch.Generator().manual_seed(m))
    ref = x @ gguf_dequant(raw, name).T
    assert_exact(triton_matmul(x, torch.from_numpy(raw), name), ref)


@pytest.mark.parametrize("name", ["Q4_K", "Q5_K"])
def test_block_kernels_refuse_a_weight_their_word_loads_cannot_read(name):
    """Q4_K/Q5_K headers are read as int32 words: a view starting off a 4-byte boundary is refused before any
    kernel runs (on a GPU a misaligned load would end the CUDA context), and a copy of it is read."""
    cols = cols_of(name)
    raw = random_raw(name, ROWS, cols, seed=3)
    fmt = BY_NAME[name]
    buffer = torch.zeros(raw.size + 1, dtype=torch.uint8)
    view = buffer[1:].view(ROWS, -1)
    view.copy_(torch.from_numpy(raw))
    x = torch.randn(2, cols, generator=torch.Generator().manual_seed(0))
    for m in (2, 9):  # the GEMV and the block product
        with pytest.raises(ValueError, match="not a multiple of 4"):
            quant_triton.qlinear(x[:1].expand(m, -1), view, fmt.ggml_type, ROWS, cols, row_bytes(fmt, cols))
    ref = x @ gguf_dequant(raw, name).T
    assert_exact(triton_matmul(x, view.clone(), name), ref)


@pytest.mark.parametrize("name", ["Q4_K", "Q6_K", "Q8_0"])
def test_the_block_gemv_split_along_columns_matches_dequantize_and_matmul(name):
    """Launch shapes the device bench tries: partial sums over runs of blocks (three blocks in two runs), rows
    that do not fill a program, fewer warps."""
    cols = 3 * 256
    raw = random_raw(name, 37, cols, seed=3)
    x = torch.randn(2, cols, generator=torch.Generator().manual_seed(3))
    fmt = BY_NAME[name]
    for config in (quant_gemv_triton.GemvConfig(block_n=8, warps=2, splits=2), quant_gemv_triton.gemv_config(37)):
        y = on_kernel_device(quant_gemv_triton.gemv, x, torch.from_numpy(raw), fmt.ggml_type, 37, cols,
                             row_bytes(fmt, cols), config)
        assert_exact(y, x @ gguf_dequant(raw, name).T)


needs_kernel = pytest.mark.skipif(native.library() is None, reason="no C compiler for the CPU kernel")


def kernel_weights(codes, scales, offsets, layout, rows: int, cols: int) -> torch.Tensor:
    """The weights as the kernel reads them, [rows, cols]: the identity through it (each output one exact
    product 1 * w)."""
    return cpu_layout.matmul(torch.eye(cols), codes, scales, offsets, layout, rows).T


@needs_kernel
@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("m", [1, 3, 4, 5, 8, 9, 16, 17, 67])
def test_cpu_kernel_matches_dequantize_and_matmul(name, m, c_kernels):
    """Panels of 16 weight rows (101: six and a part) against tiles of up to 16 rows of x (4 with AVX2 or portable
    vectors): one tile
    over several panels at once (1-8 rows), over one panel, or several tiles over a decoded panel (17: a whole
    tile and one row; 67: a prefill chunk)."""
    cols = cols_of(name)
    raw = random_raw(name, ROWS, cols, seed=3)
    x = torch.randn(m, cols, generator=torch.Generator().manual_seed(m))
    assert_exact(cpu_matmul(x, torch.from_numpy(raw), name), x @ gguf_dequant(raw, name).T)


@needs_kernel
@pytest.mark.parametrize("name", ["Q4_1", "Q4_K", "Q8_0", "Q6_K"])
def test_cpu_kernel_gives_a_row_the_same_bits_whatever_the_batch(name, c_kernels):
    """A sequence decodes the same alone, in a batch, or as a draft's verification rows: each row's sum is the
    same arithmetic whether its tile has 1 row or 16, spans one panel or four, and whether the weights are
    decoded in it or in a panel (AVX-512's 4-bit tiles: one row from halves, 2-8 rows and a second chunk of 8
    from pairs, past 16 rows from decoded pairs)."""
    cols = cols_of(name)
    raw = torch.from_numpy(random_raw(name, ROWS, cols, seed=8))
    x = torch.randn(67, cols, generator=torch.Generator().manual_seed(8))
    whole = cpu_matmul(x, raw, name)
    for rows in (slice(0, 1), slice(10, 12), slice(5, 8), slice(20, 24), slice(30, 35), slice(60, 67), slice(0, 9),
                 slice(0, 12), slice(3, 19), slice(40, 57)):
        assert torch.equal(cpu_matmul(x[rows], raw, name), whole[rows])


@needs_kernel
@pytest.mark.parametrize("name", FORMATS)
def test_cpu_repack_reads_gguf_weights_bit_for_bit(name, c_kernels):
    """Every format, K-quants included: the repacked codes and scales decode to gguf-py's weights exactly."""
    cols = cols_of(name)
    raw = random_raw(name, ROWS, cols, seed=6)
    codes, scales, offsets, layout = cpu_layout.pack(torch.from_numpy(raw), BY_NAME[name], cols)
    assert torch.equal(kernel_weights(codes, scales, offsets, layout, ROWS, cols), gguf_dequant(raw, name))
    # what is stored: 4-bit codes for the 4-bit (and 2/3-bit) formats, fp16 scales where the file's are fp16, the
    # K-quants' (and IQ4_XS's) parts (an fp16 d a superblock, an int8 a group: kind = groups a superblock) for
    # theirs, fp32 for the IQ2/IQ3/IQ1 scales (an fp16 d times a half-integer or odd integer)
    fmt = BY_NAME[name]
    table = {"IQ4_NL": 0, "IQ4_XS": 0, "MXFP4": 1}.get(name)  # 4-bit places in a table of 16 values
    assert layout.bits == (4 if name in ("Q4_0", "Q4_1", "Q4_K", "Q2_K", "Q3_K") else 8 if table is None
                           else cpu_layout.TABLE_BITS + table)
    fp32 = name.startswith(("IQ1", "IQ2", "IQ3"))
    parts = name.endswith("_K") or name == "IQ4_XS"
    assert layout.scale_kind == (fmt.block // fmt.group if parts else cpu_layout.SCALES_FP32 if fp32
                                 else cpu_layout.SCALES_FP16)
    # Q4_K: 4 bits of code and 2 x (8 bits a group of 32 + 16 bits a superblock of 256) a weight
    stored = codes.numel() + scales.numel() * scales.element_size() + (
        offsets.numel() * offsets.element_size() if offsets is not None else 0)
    if name == "Q4_K":
        assert stored * 8 / (codes.shape[0] * 16 * cols) == 4.625


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the swapped bytes may read as inf or nan
@pytest.mark.parametrize("name", list(SCALE_FIELDS))
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
    if native.library() is not None:
        with pytest.raises(AssertionError):
            assert_exact(cpu_matmul(x, wrong, name), ref)


@interpreted_only
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
    if native.library() is not None:
        w.pack_for_cpu()
        assert w.data is None and w.codes.shape[0] == 3
        assert_exact(w.matmul(x, expert=1), ref)


@pytest.mark.parametrize("formats", [("Q4_K", "Q4_K", "Q6_K"), ("Q8_0", "Q5_K", "Q4_0"), ("Q4_1", None, "Q8_0"),
                                     ("Q3_K", "Q5_0", "Q2_K")])
@pytest.mark.parametrize("tokens", [1, 9])
def test_quantized_experts_match_dequantize_and_the_reference_moe(formats, tokens):
    """quant_moe_triton.fused_moe: up to GEMV_TOKENS tokens each (token, expert) pair reads its rows block by block
    (where all three formats have block readers; Q3_K, Q5_0 and Q2_K keep the grouped kernel), more take the
    grouped GEMM; both against the torch MoE over gguf-py's dequantized experts. None: a plain float stack."""
    experts, hidden, inter, top_k = 4, 256, 256, 2
    stacks, dense = [], []
    for i, (name, rows, cols) in enumerate(zip(formats, (inter, inter, hidden), (hidden, hidden, inter))):
        if name is None:
            w = torch.randn(experts, rows, cols, generator=torch.Generator().manual_seed(i)) * 0.05
            stacks.append((w, 0, 0))
            dense.append(w)
            continue
        raw = random_raw(name, rows, cols, seed=10 + i, lead=(experts,))
        stacks.append((torch.from_numpy(raw), BY_NAME[name].ggml_type, row_bytes(BY_NAME[name], cols)))
        dense.append(torch.stack([gguf_dequant(raw[e], name) for e in range(experts)]))
    gen = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, hidden, generator=gen)
    weights, ids = moe_torch.route(torch.randn(tokens, experts, generator=gen), top_k, True)
    ref = moe_torch.fused_moe(x, torch.cat(dense[:2], 1), dense[2], weights, ids)
    moved = [(w.to(KERNEL_DEVICE), fmt, rb) for w, fmt, rb in stacks]
    out = on_kernel_device(quant_moe_triton.fused_moe, x, *moved, weights, ids)
    torch.testing.assert_close(out, ref, atol=1e-4 * ref.abs().max().item(), rtol=1e-4)


def test_float_parts_and_the_dense_code_path():
    """A fused layer may mix formats and floats; format 0 is a plain matrix in the kernels."""
    x = torch.randn(6, 64)
    w = torch.randn(20, 64)
    assert_exact(on_kernel_device(quant_triton.qlinear, x, w, 0, 20, 64, 0), x @ w.T)
    assert_exact(on_kernel_device(quant_triton.qlinear, x[:2], w, 0, 20, 64, 0), x[:2] @ w.T)



@pytest.mark.skipif(native.library() is None, reason="no C compiler for the CPU kernels")
@pytest.mark.parametrize("products", ["float32", "int8"])
@pytest.mark.parametrize("name", FORMATS)
def test_an_embedding_lookup_from_the_repacked_table_is_gguf_pys_rows(name, products):
    """QuantEmbedding reads token rows from the repacked table in one C call (rows_of_packed), in the fp32 kernel's
    panels or the int8 kernel's quads: gguf-py's dequantized rows bit for bit, as the torch path's are; an id past
    the table is an IndexError."""
    from backend.quant.modules import QuantEmbedding

    rows, cols = 50, 256
    raw = random_raw(name, rows, cols, seed=3)
    weight = QuantWeight(BY_NAME[name], rows, cols, device="cpu")
    weight.data.copy_(torch.from_numpy(raw))
    table = QuantEmbedding(weight, torch.float32)
    ids = torch.tensor([[0, 17, 49], [8, 15, 16]])
    want = gguf_dequant(raw, name)[ids]
    assert torch.equal(table(ids), want)  # the torch path, before the repack
    weight.pack_for_cpu(products)
    if weight.layout is None or weight.layout.order != {"float32": fp32_order(), "int8": "quads"}[products]:
        pytest.skip(f"{name} is not repacked for our {products} kernel")
    assert torch.equal(table(ids), want)
    with pytest.raises(IndexError, match="50 rows"):
        table(torch.tensor([3, 50]))
