"""8-bit activations on the CPU (activations="int8", cpu_int8.c): each row of x quantized per group of the weights'
16 or 32 k's, codes times those integers summed exactly in int32, then scaled per group in fp32. Oracles: gguf-py's
dequantized weights times x as quantized (float64), and the worst case of that quantization against x itself."""

import argparse
import dataclasses
import re

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf.quants import quantize

from backend import LLM, SamplingParams
from backend.engine_args import EngineArgs
from backend.kernels import native
from backend.quant import cpu_layout
from backend.quant.formats import BY_NAME
from backend.server import serve, serve_flags
from tests.backend.conftest import assert_a_sequences_bits_kept, prompts_of_lengths, use_kernel_build
from tests.backend.quant_blocks import gguf_dequant, random_raw

pytestmark = pytest.mark.skipif(native.library() is None, reason="no C compiler for the CPU kernels")

FORMATS = ["Q4_0", "Q4_1", "Q4_K", "Q2_K", "Q3_K", "Q8_0", "Q5_0", "Q5_1", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS", "MXFP4"]


def quad_ordered(name: str, rows: int, cols: int, seed: int, raw=None):
    """(raw blocks, the quad-ordered matrix as pack_for_cpu makes it: 8-bit codes within -32 .. 31 as bits 6,
    others without -128 as bits 7)."""
    raw = random_raw(name, rows, cols, seed=seed) if raw is None else raw
    codes, scales, offsets, layout = cpu_layout.pack(torch.from_numpy(raw), BY_NAME[name], cols)
    bits = cpu_layout.quad_bits([codes], layout.bits)
    quads = (cpu_layout.quad_order(codes, bits), scales, offsets, cpu_layout.Layout(
        bits, layout.group, layout.scale_kind, layout.offsets, order="quads"))
    return raw, quads


def quantized_x(x: torch.Tensor, group: int) -> torch.Tensor:
    """x's rows as the kernel quantizes them: per group, d = max |x| / 127 times round(x * 127 / max |x|)."""
    g = x.view(x.shape[0], -1, group)
    amax = g.abs().amax(-1, keepdim=True)
    inv = torch.div(torch.full_like(amax, 127.0), amax)  # a true division, as the kernel's (127.0 / t is not)
    q = torch.round(g * torch.where(amax > 0, inv, torch.zeros_like(amax)))  # fp32, to nearest even
    return (q.double() * (amax / 127.0).double()).view_as(x)


@pytest.mark.parametrize("name", FORMATS)
def test_int8_products_are_gguf_weights_times_x_quantized(name):
    """Every format against gguf-py's weights: y = x quantized @ w.T up to fp32's rounding, and within the worst
    case of 8-bit x of x @ w.T itself; a row's bits the same whatever the rows beside it (1 to 40 rows: few-row
    tiles, tiles of up to 8)."""
    cols, rows = 512, 101  # sums over 16 or 32 groups whose order shows; a part panel
    raw, quads = quad_ordered(name, rows, cols, seed=11)
    layout = quads[3]
    x = torch.randn(40, cols, generator=torch.Generator().manual_seed(1))
    x[3, :7] = 0.0  # a group partly zero, and a whole zero group: d 0
    x[4, 32:64] = 0.0
    w = gguf_dequant(raw, name).double()
    want = quantized_x(x, layout.group) @ w.T
    ours = cpu_layout.matmul(x, *quads, rows)
    err = (ours.double() - want).abs().max()
    assert err < 2e-6 * want.abs().max(), err
    exact = x.double() @ w.T  # each x off by at most half its group's step, max |x| / 254
    steps = (x.view(40, -1, layout.group).abs().amax(-1) / 254).double()
    bound = steps @ w.abs().view(rows, -1, layout.group).sum(-1).T
    assert ((ours.double() - exact).abs() <= bound + 1e-5).all()
    assert (ours.double() - exact).abs().max() > 0  # x really was quantized
    for m in (1, 2, 3, 5, 8, 9, 17, 33):
        assert torch.equal(cpu_layout.matmul(x[:m], *quads, rows), ours[:m]), m
        assert torch.equal(cpu_layout.matmul(x[40 - m:], *quads, rows), ours[40 - m:]), m


@pytest.mark.parametrize("build", ["avx2", "avx_vnni", "portable"])
@pytest.mark.parametrize(
    "name", ["Q4_K", "Q8_0", "Q6_K", "Q5_1", "Q5_K", "Q8_0 with -128", "IQ4_XS", "MXFP4", "IQ3_XXS", "IQ2_XS"])
def test_int8_products_are_the_same_bits_in_every_build(name, build, monkeypatch):
    """The native build's integer sums (VNNI, or AVX2's two-step products: nibbles, 6-bit codes composed from
    nibbles and their high bits, 8-bit codes as two nibbles, or q times x's sign where no code is -128, or q + 64
    unsigned where every code fits -64 .. 63 (IQ3_XXS's and IQ2's grids), a table's
    values looked up from 4-bit places, a tile at a time or, on 8 lanes from two tiles of rows, once a call; on 8
    lanes 4-bit codes from 8 rows in tiles of half a panel) against AVX2's and GCC's portable vectors, which multiply
    byte by byte: the same bits, at 1 to 20 rows."""
    raw = None
    if name == "Q8_0 with -128":
        name, raw = "Q8_0", random_raw("Q8_0", 70, 256, seed=21)
        raw[5, 2 + 7] = 0x80  # block 0's code 7 of row 5: q = -128
    raw, quads = quad_ordered(name, 70, 256, seed=21, raw=raw)
    tables = {"IQ4_XS": cpu_layout.TABLE_BITS, "MXFP4": cpu_layout.TABLE_BITS + 1}  # 4-bit places in a table
    assert quads[3].bits == {"Q4_K": 4, "Q6_K": 6, "Q5_1": 6, "Q5_K": 6, "IQ3_XXS": 5, "IQ2_XS": 5, **tables}.get(
        name, 8 if raw[5, 9] == 0x80 else 7)
    x = torch.randn(20, 256, generator=torch.Generator().manual_seed(22))
    native_y = [cpu_layout.matmul(x[:m], *quads, 70) for m in (1, 3, 6, 8, 20)]
    use_kernel_build(build, monkeypatch)
    for m, y in zip((1, 3, 6, 8, 20), native_y):
        assert torch.equal(cpu_layout.matmul(x[:m], *quads, 70), y), m


def test_int8_products_at_the_extremes_of_8_bit_codes():
    """Codes of +-127 (stored as 255 and 1) times x quantized to +-127 everywhere: sums a 16-bit step would
    saturate (2 * 255 * 127 > 32767), exact here against the float64 oracle."""
    cols = 256
    w = torch.ones(16, cols)
    w[1::2] *= -1.0
    w[2, ::3] = 0.5
    raw = quantize(w.numpy(), T.Q8_0)
    codes, scales, offsets, layout = cpu_layout.pack(torch.from_numpy(raw), BY_NAME["Q8_0"], cols)
    quads = (cpu_layout.quad_order(codes, 8), scales, offsets,
             cpu_layout.Layout(8, layout.group, layout.scale_kind, layout.offsets, order="quads"))
    x = torch.ones(3, cols)
    x[1] = -1.0
    x[2, ::2] = -1.0
    want = quantized_x(x, layout.group) @ gguf_dequant(raw, "Q8_0").double().T
    ours = cpu_layout.matmul(x, *quads, 16).double()
    assert (ours - want).abs().max() <= 1e-6 * want.abs().max()
    assert abs(ours[0, 0] - cols) < 0.1 and abs(ours[1, 0] + cols) < 0.1  # d is fp16: 127 d is not quite 1


@pytest.mark.parametrize("build", ["native", "avx2", "avx_vnni", "portable"])
@pytest.mark.parametrize("digits", [False, True])
def test_int8_products_at_the_extremes_of_codes_within_64(digits, build, monkeypatch):
    """8-bit codes at -64 and 63, the ends of bits 5 (AVX2 multiplies q + 64 <= 127 as unsigned bytes), times x at
    +-127 (one digit: two products of a pair reach 32,258, just under vpmaddubsw's 32,767) or random x in three
    digits (a digit may be -128: 32,512); exact in every build against the float64 oracle (digits: to fp32's
    precision)."""
    cols, rows = 256, 16
    w = torch.full((rows, cols), 63.0)
    w[1::2] = -64.0
    w[2, ::3] = -64.0
    raw = np.zeros((rows, cols // 32, 34), dtype=np.uint8)  # Q8_0 blocks: d = 1, codes the weights themselves
    raw[..., :2] = np.array([1.0], dtype=np.float16).view(np.uint8)
    raw[..., 2:] = w.numpy().reshape(rows, cols // 32, 32).astype(np.int8).view(np.uint8)
    raw = raw.reshape(rows, -1)
    _, quads = quad_ordered("Q8_0", rows, cols, seed=0, raw=raw)
    assert quads[3].bits == 5
    if digits:
        quads = (*quads[:3], dataclasses.replace(quads[3], order="digits"))
    x = torch.ones(3, cols)
    x[1] = -1.0
    x[2, ::2] = -1.0
    if digits:
        x = torch.randn(3, cols, generator=torch.Generator().manual_seed(5))
    want = (quantized_x(x, 32) if not digits else x.double()) @ gguf_dequant(raw, "Q8_0").double().T
    use_kernel_build(build, monkeypatch)
    ours = cpu_layout.matmul(x, *quads, rows).double()
    assert (ours - want).abs().max() <= 1e-6 * want.abs().max()


@pytest.mark.parametrize("build", ["native", "avx2", "avx_vnni", "portable"])
@pytest.mark.parametrize("name", ["Q4_0", "Q6_K"])
def test_int8_products_at_the_extremes_of_4_and_6_bit_codes(name, build, monkeypatch):
    """Every code at its top (4-bit 15, 6-bit 63) times x quantized to +-127: the largest sums AVX2's kernel keeps
    in 16-bit lanes (a 4-bit group's 16 k's a lane: 30,480; two 6-bit products of pairs: 32,004, composed in the
    tiles or, on 8 lanes from two tiles of rows, laid out as bytes once a call), exact in every build against the
    float64 oracle."""
    cols, rows = 256, 16
    raw = np.zeros((rows, cols // BY_NAME[name].block, BY_NAME[name].block_bytes), dtype=np.uint8)
    if name == "Q4_0":  # d = 1, every nibble 15: w = 15 - 8
        raw[..., :2] = np.array([1.0], dtype=np.float16).view(np.uint8)
        raw[..., 2:] = 0xFF
    else:  # Q6_K: every low nibble and high pair set (q = 63 - 32), scales 1, d = 1
        raw[..., :192] = 0xFF
        raw[..., 192:208] = 1
        raw[..., 208:] = np.array([1.0], dtype=np.float16).view(np.uint8)
    raw = raw.reshape(rows, -1)
    _, quads = quad_ordered(name, rows, cols, seed=0, raw=raw)
    x = torch.ones(3, cols)
    x[1] = -1.0
    x[2, ::2] = -1.0
    x = x.repeat(3, 1)  # 9 rows: two tiles' worth on 8 lanes
    want = quantized_x(x, quads[3].group) @ gguf_dequant(raw, name).double().T
    use_kernel_build(build, monkeypatch)
    ours = cpu_layout.matmul(x, *quads, rows).double()
    assert (ours - want).abs().max() <= 1e-6 * want.abs().max()
    assert abs(ours[0, 0] - cols * (7 if name == "Q4_0" else 31)) < 1e-3


def test_int8_products_of_tiny_activations():
    """Rows of x far below 1 (down to denormals) are quantized as the same rows scaled by a power of two would be:
    y within fp32's rounding of x quantized @ w.T (and its denormals' spacing, 1.4e-45), not garbage from
    127 / max |x| overflowing (before: 1.2e-37 off for the 1e-37 row)."""
    raw, quads = quad_ordered("Q4_K", 64, 256, seed=5)
    scales = torch.tensor([[1e-20], [1e-30], [1e-37], [1e-42]])
    x = torch.randn(4, 256, generator=torch.Generator().manual_seed(6)) * scales
    w = gguf_dequant(raw, "Q4_K").double()
    want = quantized_x(x * 2.0**64, quads[3].group) / 2.0**64 @ w.T
    ours = cpu_layout.matmul(x, *quads, 64).double()
    err = (ours - want).abs().amax(1)
    assert (err < 2e-6 * want.abs().amax(1) + 1e-40).all(), err


def test_int8_products_carry_nan_and_infinity():
    """A NaN or an infinity in x makes its row's outputs NaN, as the fp32 kernel's would be; other rows unharmed."""
    _, quads = quad_ordered("Q8_0", 64, 64, seed=2)
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(3))
    clean = cpu_layout.matmul(x, *quads, 64)
    x[0, 5], x[2, 40] = float("nan"), float("inf")
    y = cpu_layout.matmul(x, *quads, 64)
    assert y[0].isnan().all() and y[2].isnan().all() and torch.equal(y[1], clean[1])


def test_quad_order_puts_four_ks_of_a_row_in_a_lane():
    """Byte 4r + i of a panel's 64 bytes: 8-bit, row r's q at k = 4j + i plus 128; 4-bit, row r's q at k = 8j + i
    in the low nibble and at 8j + 4 + i in the high one; 6-bit, per 16 k's (192 bytes), u = q + 32's low 4 bits
    as two 4-bit units, then byte 128 + 4r + i holding the high 2 bits of k = 16j + i, + 4, + 8, + 12."""
    for name, bits in (("Q4_1", 4), ("Q8_0", 8), ("Q6_K", 6), ("IQ3_XXS", 8)):
        cols = 256
        codes, *_ = cpu_layout.pack(torch.from_numpy(random_raw(name, 32, cols, seed=3)), BY_NAME[name], cols)
        q = torch.cat([codes & 15, codes >> 4], dim=-1).int() if bits == 4 else codes.view(torch.int8).int()
        assert cpu_layout.quad_bits([codes], 4 if bits == 4 else 8) in ((bits,) if bits != 8 else (5, 7, 8))
        quads = cpu_layout.quad_order(codes, bits)
        ks, size = {4: (8, 64), 6: (16, 192), 8: (4, 64)}[bits]  # k's per unit, its bytes
        assert quads.dtype == torch.uint8 and quads.shape == (codes.shape[0], cols // ks, size)
        for p, j, r, i in [(0, 0, 0, 0), (0, 1, 3, 2), (1, 3, 15, 3), (3, quads.shape[1] - 1, 9, 1)]:
            if bits == 6:
                block, u = quads[p, j].int(), q[p, 16 * j: 16 * j + 16, r] + 32
                for half in (0, 1):
                    byte = int(block[64 * half + 4 * r + i])
                    assert (byte & 15, byte >> 4) == (int(u[8 * half + i]) & 15, int(u[8 * half + 4 + i]) & 15)
                assert int(block[128 + 4 * r + i]) == sum((int(u[4 * t + i]) >> 4) << (2 * t) for t in range(4))
                continue
            byte = int(quads[p, j, 4 * r + i])
            if bits == 4:
                assert (byte & 15, byte >> 4) == (int(q[p, 8 * j + i, r]), int(q[p, 8 * j + 4 + i, r]))
            else:
                assert byte == int(q[p, 4 * j + i, r]) + 128


def test_an_int8_engine_on_the_cpu(tiny_gguf):
    """activations="int8" on a GGUF: every dense layer's codes in quad order, every step in the one-call C loop, and
    the next token's top logprobs within 8-bit activations' error of the fp32 engine's (itself exact against
    transformers), the greedy token the fp32 one's but where the fp32 engine's top two are near a tie, for a lone
    prompt and 20 at once."""
    path, _ = tiny_gguf("llama")
    int8 = LLM(str(path), activations="int8", block_size=8)
    fp32 = LLM(str(path), block_size=8)
    engine = int8.engine
    assert engine.products == "int8" and engine.dtype == torch.float32 and engine.runner.cpu_decoder is not None
    assert {m.layout.order for m in engine.model.modules() if getattr(m, "layout", None) is not None} == {"quads"}
    first = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, logprobs=5)
    for prompts in (prompts_of_lengths(12), prompts_of_lengths(*range(5, 25))):
        ours = [o.outputs[0].logprobs[0] for o in int8.generate(prompts, first)]
        theirs = [o.outputs[0].logprobs[0] for o in fp32.generate(prompts, first)]
        gaps, same = [], 0
        for a, b in zip(ours, theirs):
            a, b = {t: lp.logprob for t, lp in a.items()}, {t: lp.logprob for t, lp in b.items()}
            gaps += [abs(a[t] - b[t]) for t in a.keys() & b.keys()]
            mine, best = max(a, key=a.get), max(b, key=b.get)  # a random model's flat logits: near ties happen
            assert mine == best or b[best] - b.get(mine, -1e9) < 0.3, (a, b)
            same += mine == best
        assert 0 < max(gaps) < 0.4  # measured up to 0.23 (a random model: peaked logits, flat and near ties)
        assert same >= 0.8 * len(prompts)


def test_an_int8_engine_keeps_a_sequences_bits(tiny_gguf):
    """A row's integer sums are exact and its scaling fixed: a sequence's tokens and logprobs are the same alone,
    decoding beside 4 others, and verifying its drafts (runs of up to 17 rows, the most speculation makes)."""
    path, _ = tiny_gguf("llama")
    assert_a_sequences_bits_kept(path, 16, activations="int8")


@pytest.mark.parametrize("settings, message", [
    ({"activations": "int4"}, "activations 'int4' is not supported; use float32 or int8"),
    ({"activations": "int8", "dtype": "bfloat16"}, "dtype bfloat16 cannot go with it: leave dtype as auto"),
    ({"activations": "int8", "quantization": "dequantize"}, "quantization='dequantize'); leave activations as float32"),
])
def test_int8_activations_refused_where_they_cannot_run(tiny_gguf, settings, message):
    path, _ = tiny_gguf("llama")
    with pytest.raises(ValueError, match=re.escape(message)):
        LLM(str(path), block_size=8, **settings)


def test_int8_activations_need_quantized_blocks(tiny_gguf):
    kinds = ("token_embd", "output", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
    path, _ = tiny_gguf("llama", "f16", policy=dict.fromkeys(kinds, "F16"))
    with pytest.raises(ValueError, match=r"it has no GGUF blocks of a quantized type \(Q4_0 .. Q8_0, the K-quants, the IQ"):
        LLM(str(path), activations="int8", block_size=8)


def test_the_server_flag_and_engine_args_carry_activations():
    """--activations int8 reaches the engine's settings from the server's command line, as from EngineArgs; the
    parser refuses anything but float32 and int8."""
    parser = argparse.ArgumentParser()
    serve_flags.add_arguments(parser)
    args = parser.parse_args(["--model", "smollm2", "--activations", "int8"])
    assert serve._engine_config(args, "smollm2", 0.9).activations == "int8"
    assert EngineArgs(model="smollm2", activations="int8").create_engine_config().activations == "int8"
    with pytest.raises(SystemExit):
        parser.parse_args(["--model", "smollm2", "--activations", "int4"])
