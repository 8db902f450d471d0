"""The formats of a 16-value table (IQ4_NL, IQ4_XS, MXFP4) on the CPU: kept as 4-bit places in the table and looked
up inside every kernel that reads them (the fp32 panels, the 8-bit quads and digits, the MoE call, an embedding's
rows), AMX tiles' pairs given the values' 8-bit codes instead. Oracles: gguf-py's dequantize, and float64 matmuls
of its weights."""

import dataclasses

import pytest
import torch

from backend.kernels import native
from backend.kernels.moe_torch import fused_moe, route
from backend.quant import cpu_layout
from backend.quant.codebooks import table_values
from backend.quant.experts import QuantExperts
from backend.quant.formats import BY_NAME
from backend.quant.modules import QuantWeight
from tests.backend.conftest import fp32_order
from tests.backend.quant_blocks import gguf_dequant, random_raw

pytestmark = pytest.mark.skipif(native.library() is None, reason="no C compiler for the CPU kernels")

TABLED = {
    "IQ4_NL": "IQ4_NL",
    "IQ4_XS": "IQ4_NL",
    "MXFP4": "MXFP4",
}  # format -> the table its values come from


def packed(name: str, rows: int, cols: int, seed: int):
    raw = random_raw(name, rows, cols, seed=seed)
    return raw, cpu_layout.pack(torch.from_numpy(raw), BY_NAME[name], cols)


@pytest.mark.parametrize("name", list(TABLED))
def test_table_formats_keep_4_bit_places_that_decode_as_gguf_py(name, c_kernels):
    """Two codes a byte, each a place in the format's table; through the kernel (an identity matrix: each output one
    exact product) and as an embedding's rows, in panels and in quads, the weights are gguf-py's bit for bit, in
    every build (AVX-512's lookup in the codes' vpermps, AVX2's byte shuffles, the portable build's loop)."""
    rows, cols = 70, 512
    raw, (codes, scales, offsets, layout) = packed(name, rows, cols, seed=4)
    want = gguf_dequant(raw, name)
    assert layout.bits == cpu_layout.TABLE_BITS + cpu_layout.TABLES.index(TABLED[name])
    assert (
        codes.shape == (rows // 16 + 1 + 3, cols, 8) and offsets is None
    )  # 80 rows in panels: 4 bits a weight
    places = torch.cat([codes & 15, codes >> 4]).unique()
    assert len(places) == (
        15 if name == "MXFP4" else 16
    )  # every place read below (MXFP4's -0 stored as its +0)
    ours = cpu_layout.matmul(torch.eye(cols), codes, scales, None, layout, rows).T
    assert torch.equal(ours, want)
    quads = cpu_layout.quad_order(codes, cpu_layout.quad_bits([codes], layout.bits))
    ids = torch.tensor([0, 5, 33, 69])
    for order, c in (("panels", codes), ("quads", quads)):
        out = torch.empty(len(ids), cols)
        assert native.library().rows_of_packed(
            c.data_ptr(),
            scales.data_ptr(),
            None,
            rows,
            cols,
            layout.group,
            layout.bits,
            layout.scale_kind,
            cpu_layout.ORDERS.index(order),
            ids.data_ptr(),
            len(ids),
            out.data_ptr(),
        )
        assert torch.equal(out, want[ids]), order


@pytest.mark.parametrize("name", list(TABLED))
@pytest.mark.parametrize("order", ["panels", "quads", "digits"])
def test_table_codes_multiply_as_their_values_do(name, order, c_kernels):
    """x @ w.T against float64 of gguf-py's weights: fp32 products and digits within fp32's rounding of the sums,
    8-bit x within its quantization's worst case; a row's bits the same at 1, 3 and 20 rows."""
    rows, cols = 101, 512
    raw, (codes, scales, _, layout) = packed(name, rows, cols, seed=6)
    w = gguf_dequant(raw, name).double()
    if order != "panels":
        codes = cpu_layout.quad_order(codes, cpu_layout.quad_bits([codes], layout.bits))
        layout = dataclasses.replace(layout, order=order)
    x = torch.randn(20, cols, generator=torch.Generator().manual_seed(7))
    ours = cpu_layout.matmul(x, codes, scales, None, layout, rows).double()
    exact = x.double() @ w.T
    scale = x.double().abs() @ w.abs().T
    if order == "quads":
        steps = (x.view(20, -1, layout.group).abs().amax(-1) / 254).double()
        bound = steps @ w.abs().view(rows, -1, layout.group).sum(-1).T + 1e-6 * scale
    else:
        bound = scale * 2.0**-20
    assert ((ours - exact).abs() <= bound).all()
    for m in (1, 3):
        assert torch.equal(cpu_layout.matmul(x[:m], codes, scales, None, layout, rows).double(), ours[:m])


@pytest.mark.parametrize("products", ["float32", "int8"])
def test_table_experts_in_one_call_match_the_float_experts(products, c_kernels):
    """An IQ4_XS gate, MXFP4 up and IQ4_NL down stack, packed as the loader packs them, through cpu_moe.c's one call
    (a decode step's tokens): the float64 MoE of gguf-py's weights, within fp32's rounding (8-bit x: its own)."""
    experts, hidden, inter = 4, 256, 256
    weights, dense = [], []
    for i, (name, rows, cols) in enumerate(
        zip(("IQ4_XS", "MXFP4", "IQ4_NL"), (inter, inter, hidden), (hidden, hidden, inter))
    ):
        raw = random_raw(name, rows, cols, seed=20 + i, lead=(experts,))
        w = QuantWeight(BY_NAME[name], rows, cols, lead=(experts,), device="cpu")
        w.data.copy_(torch.from_numpy(raw))
        w.pack_for_cpu(products)
        assert cpu_layout.tabled(w.layout.bits)
        assert w.layout.order == ("quads" if products == "int8" else fp32_order())
        weights.append(w)
        dense.append(gguf_dequant(raw, name).double())
    module = QuantExperts(*weights)
    g = torch.Generator().manual_seed(8)
    x = torch.randn(5, hidden, generator=g)
    topk_weights, ids = route(torch.randn(5, experts, generator=g), 2, True)
    ref = fused_moe(x.double(), torch.cat(dense[:2], dim=1), dense[2], topk_weights.double(), ids)
    out = module(x, topk_weights, ids).double()
    tol = 2e-2 if products == "int8" else 1e-5
    assert (out - ref).abs().max() <= tol * ref.abs().max()


@pytest.mark.parametrize("name", ["IQ4_XS", "MXFP4"])
def test_amx_tiles_get_the_values_8_bit_codes(name, monkeypatch):
    """The AMX kernels read no table: a bfloat16 engine's weights on the tiles are the values' 8-bit codes (7 bits
    where every value fits -64 .. 63: MXFP4's), which decode to gguf-py's weights; pair_order refuses 4-bit places
    given as 8-bit codes."""
    rows, cols = 40, 256
    raw, (codes, scales, _, layout) = packed(name, rows, cols, seed=9)
    values = cpu_layout.untabled(codes, layout.bits)
    assert values.shape == (codes.shape[0], cols, 16)
    assert set(values.view(torch.int8).unique().tolist()) <= set(table_values(TABLED[name], "cpu").tolist())
    as_bytes = dataclasses.replace(layout, bits=8)
    assert torch.equal(
        cpu_layout.matmul(torch.eye(cols), values, scales, None, as_bytes, rows).T, gguf_dequant(raw, name)
    )
    with pytest.raises(ValueError, match="codes of 4 bits"):
        cpu_layout.pair_order(codes, 8)
    monkeypatch.setattr(native, "amx", lambda: True)
    weight = QuantWeight(BY_NAME[name], rows, cols, device="cpu")
    weight.data.copy_(torch.from_numpy(raw))
    weight.pack_for_cpu("bfloat16")
    assert (weight.layout.order, weight.layout.bits) == ("pairs", 7 if name == "MXFP4" else 8)
    assert torch.equal(weight.codes, cpu_layout.pair_order(values, weight.layout.bits))
