"""bfloat16 on the CPU for a GGUF kept in its blocks: fp32 around the matmuls, and where the CPU has AMX the codes
stored in the tiles' order and every product bf16's: up to 16 rows fed the codes themselves (cpu_amx_codes.c),
more from weights rounded to bf16 (cpu_amx.c). Without AMX every product is fp32."""

import ctypes
import dataclasses
import platform

import pytest
import torch

from backend import LLM, SamplingParams
from backend.kernels import native
from backend.quant import cpu_layout
from backend.quant.formats import BY_NAME
from tests.backend.conftest import assert_a_sequences_bits_kept, fp32_order, prompts_of_lengths
from tests.backend.quant_blocks import gguf_dequant, random_raw

pytestmark = pytest.mark.skipif(native.library() is None, reason="no C compiler for the CPU kernels")


def amx_cpu() -> bool:
    """The CPU has AMX and the kernel lets this process use its tiles (arch_prctl ARCH_REQ_XCOMP_PERM for
    XTILEDATA, Linux 5.16 and later: an older kernel leaves AMX unusable however new the CPU)."""
    if "amx_bf16" not in native._cpu_key().split() or platform.machine() != "x86_64":
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.syscall(158, 0x1023, 18) == 0  # SYS_arch_prctl on x86-64


FORMATS = ["Q4_0", "Q4_1", "Q4_K", "Q2_K", "Q3_K", "Q8_0", "Q5_0", "Q5_1", "Q5_K", "Q6_K"]
needs_amx = pytest.mark.skipif(not amx_cpu(), reason="codes in the tiles' order are for AMX only")


def pair_ordered(name: str, rows: int, cols: int, seed: int):
    """gguf-py's blocks, and their codes in the tiles' order with scales and offsets and layout."""
    raw = random_raw(name, rows, cols, seed=seed)
    codes, scales, offsets, layout = cpu_layout.pack(torch.from_numpy(raw), BY_NAME[name], cols)
    bits = cpu_layout.paired_bits([codes], layout.bits)
    return raw, (cpu_layout.pair_order(codes, bits), scales, offsets,
                 dataclasses.replace(layout, bits=bits, order="pairs"))


@needs_amx
@pytest.mark.parametrize("name", FORMATS)
def test_codes_on_the_tiles(name):
    """Up to 16 rows: x rounded to bf16 times gguf-py's weights exactly (the codes, not weights rounded to bf16),
    summed in fp32; a row's bits the same whatever the rows beside it. Past 16: weights and x each rounded to bf16,
    their products summed in fp32."""
    cols, rows = 512, 101  # groups of 16 or 32 k (one tile product each) in sums whose order shows; a part panel
    raw, paired = pair_ordered(name, rows, cols, seed=11)
    x = torch.randn(40, cols, generator=torch.Generator().manual_seed(1))
    w = gguf_dequant(raw, name).double()
    exact, rounded = x.bfloat16().double() @ w.T, x.bfloat16().double() @ w.bfloat16().double().T
    sixteen = cpu_layout.matmul(x[:16], *paired, rows)
    err, err_rounded = (sixteen.double() - exact[:16]).abs().max(), (rounded - exact).abs().max()
    assert err < 1e-5 * exact.abs().max() and err < err_rounded / 50, (err, err_rounded)
    for m in (1, 2, 7, 15):
        assert torch.equal(cpu_layout.matmul(x[:m], *paired, rows), sixteen[:m]), m
        assert torch.equal(cpu_layout.matmul(x[16 - m:16], *paired, rows), sixteen[16 - m:]), m
    many = cpu_layout.matmul(x, *paired, rows)
    torch.testing.assert_close(many.double(), rounded, atol=1e-5 * rounded.abs().max().item(), rtol=1e-5)
    assert not torch.equal(many[:16], sixteen)


@needs_amx
@pytest.mark.parametrize("name", ["Q4_1", "Q8_0", "Q4_K", "Q6_K"])
def test_past_16_rows_a_row_does_not_depend_on_the_rows_beside(name):
    """Up to 32 rows the kernel decodes 32 k's at a time between tile products, past 32 each panel once for all
    rows (cpu_amx.c): a row's bits the same either way."""
    block = BY_NAME[name].block
    cols, rows = block * max(2, 256 // block), 70  # 8 or more blocks of 32 k: sums whose order shows
    _, paired = pair_ordered(name, rows, cols, seed=4)
    x = torch.randn(100, cols, generator=torch.Generator().manual_seed(5))
    whole = cpu_layout.matmul(x, *paired, rows)
    for m in (17, 31, 32, 33, 64):
        assert torch.equal(cpu_layout.matmul(x[:m], *paired, rows), whole[:m]), m
        assert torch.equal(cpu_layout.matmul(x[100 - m:], *paired, rows), whole[100 - m:]), m


def test_pair_order_moves_the_codes_where_the_tiles_read_them():
    """Word i of a weight tile's row r is column i // 2 at k = 2r + i % 2: 4-bit codes two rows a 32 bytes (the low
    nibbles row 2c, the high 2c + 1), 8-bit ones a row, q + 64 where every q fits 7 bits, else q + 128."""
    for name, bits in (("Q4_1", 4), ("Q6_K", 7), ("Q8_0", 8)):
        cols = BY_NAME[name].block
        codes, *_ = cpu_layout.pack(torch.from_numpy(random_raw(name, 32, cols, seed=3)), BY_NAME[name], cols)
        assert cpu_layout.paired_bits([codes], 4 if bits == 4 else 8) == bits
        q = torch.cat([codes & 15, codes >> 4], dim=-1) if bits == 4 else codes.view(torch.int8).int()
        paired = cpu_layout.pair_order(codes, bits)
        assert paired.dtype == torch.uint8 and paired.shape == (codes.shape[0], cols // (4 if bits == 4 else 2), 32)
        for p, r, i in [(0, 0, 0), (0, 0, 1), (1, 3, 17), (3, cols // 2 - 1, 31), (2, 7, 6)]:
            want = int(q[p, 2 * r + i % 2, i // 2])
            if bits == 4:
                assert (int(paired[p, r // 2, i]) >> (4 * (r % 2))) & 15 == want
            else:
                assert int(paired[p, r, i]) == want + (64 if bits == 7 else 128)


def test_a_bfloat16_engine_on_the_cpu(tiny_gguf):
    """dtype bfloat16 on a GGUF: fp32 modules and cache, every step in the one-call C loop; with AMX every layer's
    codes in the tiles' order, so a lone sequence (a 12-token prompt, then one row a step) and 20 prompts at once
    both go through bf16 products and stay within bf16's rounding of the fp32 engine; without AMX, the fp32
    engine's bits."""
    path, _ = tiny_gguf("llama")
    bf16 = LLM(str(path), dtype="bfloat16", block_size=8)
    fp32 = LLM(str(path), dtype="float32", block_size=8)
    engine = bf16.engine
    assert engine.products == "bfloat16" and engine.dtype == torch.float32 and engine.runner.cpu_decoder is not None
    layouts = [m.layout for m in engine.model.modules() if getattr(m, "layout", None) is not None]
    assert {lay.order == "pairs" for lay in layouts} == {amx_cpu()}
    # Q4_x; Q5_0 and Q6_K (their quads: 6-bit); Q8_0 (without -128: 7)
    want = {4, 7, 8} if amx_cpu() else {4, 6, 7} if fp32_order() == "digits" else {4, 8}
    assert {lay.bits for lay in layouts} == want
    first = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, logprobs=0)
    for prompts in (prompts_of_lengths(12), prompts_of_lengths(*range(5, 25))):
        ours = [o.outputs[0].logprobs[0] for o in bf16.generate(prompts, first)]
        theirs = [o.outputs[0].logprobs[0] for o in fp32.generate(prompts, first)]
        assert [list(a) for a in ours] == [list(b) for b in theirs]  # the same greedy tokens (none is a near tie)
        gaps = [abs(next(iter(a.values())).logprob - next(iter(b.values())).logprob) for a, b in zip(ours, theirs)]
        assert max(gaps) < 0.15  # a random model's logits through bf16 products: measured up to 0.1
        assert (max(gaps) > 0) == amx_cpu()


def test_a_bfloat16_engine_keeps_a_sequences_bits_up_to_16_rows(tiny_gguf):
    """Steps of up to 16 rows feed the codes to the tiles, each row's sums in one order: a sequence's tokens and
    logprobs are the same alone, decoding beside 4 others, and verifying its drafts (runs of up to 16 rows)."""
    path, _ = tiny_gguf("llama")
    assert_a_sequences_bits_kept(path, 15, dtype="bfloat16")


def test_bfloat16_is_bf16_modules_for_a_gguf_without_quantized_layers(tiny_gguf):
    """An F16 GGUF has no blocks for our kernels: bfloat16 stays PyTorch's bf16 modules (half the memory of fp32)."""
    kinds = ("token_embd", "output", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
    path, _ = tiny_gguf("llama", "f16", policy=dict.fromkeys(kinds, "F16"))
    engine = LLM(str(path), dtype="bfloat16", block_size=8).engine
    assert engine.products == "float32" and engine.dtype == torch.bfloat16
    floats = {n: t for n, t in [*engine.model.named_parameters(), *engine.model.named_buffers()]
              if t.is_floating_point() and n != "cos_sin"}  # the rotary table is fp32 in every dtype
    assert floats and all(t.dtype == torch.bfloat16 for t in floats.values())

