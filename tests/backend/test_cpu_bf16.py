"""bfloat16 on the CPU for a GGUF kept in its blocks: fp32 around the matmuls, and products in bf16 on AMX tiles
where the CPU has AMX: for 4-bit codes (stored in the tiles' order) every matmul, up to 16 rows from the codes
themselves (cpu_amx_codes.c), more from weights rounded to bf16 (cpu_amx.c); for 8-bit codes matmuls of more than
16 rows, or of 7 or more in a step of decode rows alone (cpu_native.bf16_from_rows), fp32 below that. Without AMX
every product is fp32."""

import ctypes
import dataclasses
import platform

import pytest
import torch

from backend import LLM, SamplingParams
from backend.kernels import native
from backend.quant import cpu_native
from backend.quant.formats import BY_NAME
from tests.backend.conftest import prompts_of_lengths
from tests.backend.quant_blocks import gguf_dequant, random_raw

pytestmark = pytest.mark.skipif(native.library() is None, reason="no C compiler for the CPU kernels")


def amx_cpu() -> bool:
    """The CPU has AMX and the kernel lets this process use its tiles (arch_prctl ARCH_REQ_XCOMP_PERM for
    XTILEDATA, Linux 5.16 and later: an older kernel leaves AMX unusable however new the CPU)."""
    if "amx_bf16" not in native._cpu_key().split() or platform.machine() != "x86_64":
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.syscall(158, 0x1023, 18) == 0  # SYS_arch_prctl on x86-64


@pytest.mark.parametrize("name", ["Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q6_K"])
@pytest.mark.parametrize("m", [16, 17, 40, 100])
def test_bf16_products_past_16_rows(name, m):
    """Past 16 rows: gguf-py's weights and x each rounded to bf16, their products summed in fp32 (on a CPU with
    AMX; a CPU without keeps the fp32 kernel's bits); 16 rows or fewer: the fp32 kernel's bits."""
    cols, rows = 3 * BY_NAME[name].block, 101  # weight rows: six panels of 16 and a part
    raw = random_raw(name, rows, cols, seed=9)
    codes, scales, offsets, layout = cpu_native.pack(torch.from_numpy(raw), BY_NAME[name], cols)
    x = torch.randn(m, cols, generator=torch.Generator().manual_seed(m))
    fp32 = cpu_native.matmul(x, codes, scales, offsets, layout, rows)
    ours = cpu_native.matmul(x, codes, scales, offsets, dataclasses.replace(layout, bf16=True), rows)
    if m <= 16 or not amx_cpu():
        assert torch.equal(ours, fp32)
        return
    ref = x.bfloat16().double() @ gguf_dequant(raw, name).bfloat16().double().T
    torch.testing.assert_close(ours.double(), ref, atol=1e-5 * ref.abs().max().item(), rtol=1e-5)
    assert not torch.equal(ours, fp32)  # the products were bf16's


FOUR_BIT = ["Q4_0", "Q4_1", "Q4_K", "Q2_K", "Q3_K"]


def pair_ordered(name: str, rows: int, cols: int, seed: int):
    raw = random_raw(name, rows, cols, seed=seed)
    codes, scales, offsets, layout = cpu_native.pack(torch.from_numpy(raw), BY_NAME[name], cols)
    paired = (cpu_native.pair_order(codes), scales, offsets,
              dataclasses.replace(layout, bf16=True, pairs_order=True))
    return raw, (codes, scales, offsets, dataclasses.replace(layout, bf16=True)), paired


@pytest.mark.skipif(not amx_cpu(), reason="codes in the tiles' order are for AMX only")
@pytest.mark.parametrize("name", FOUR_BIT)
def test_4_bit_codes_on_the_tiles_up_to_16_rows(name):
    """Up to 16 rows: x rounded to bf16 times gguf-py's weights exactly (the codes, not weights rounded to bf16),
    summed in fp32; a row's bits the same whatever the rows beside it. Past 16: the bf16-weight tiles' bits, read
    from the same codes."""
    cols, rows = 512, 101  # groups of 16 or 32 k (one tile product each) in sums whose order shows
    raw, plain, paired = pair_ordered(name, rows, cols, seed=11)
    x = torch.randn(40, cols, generator=torch.Generator().manual_seed(1))
    w = gguf_dequant(raw, name).double()
    exact, rounded = x.bfloat16().double() @ w.T, x.bfloat16().double() @ w.bfloat16().double().T
    sixteen = cpu_native.matmul(x[:16], *paired, rows)
    err, err_rounded = ((sixteen.double() - exact[:16]).abs().max(), (rounded - exact).abs().max())
    assert err < 1e-5 * exact.abs().max() and err < err_rounded / 50, (err, err_rounded)
    for m in (1, 2, 7, 15):
        assert torch.equal(cpu_native.matmul(x[:m], *paired, rows), sixteen[:m]), m
        assert torch.equal(cpu_native.matmul(x[16 - m:16], *paired, rows), sixteen[16 - m:]), m
    token = cpu_native.bf16_from_rows.set(1)
    try:
        for m in (17, 40):
            assert torch.equal(cpu_native.matmul(x[:m], *paired, rows), cpu_native.matmul(x[:m], *plain, rows)), m
    finally:
        cpu_native.bf16_from_rows.reset(token)


def test_pair_order_moves_the_codes_where_the_tiles_read_them():
    """Word i of a weight tile's row r (32 bytes for rows 2c and 2c + 1) is column i // 2 at k = 2r + i % 2."""
    raw = random_raw("Q4_1", 32, 64, seed=3)
    codes, *_ = cpu_native.pack(torch.from_numpy(raw), BY_NAME["Q4_1"], 64)
    q = torch.cat([codes & 15, codes >> 4], dim=-1)  # [panel, k, row of the panel]
    paired = cpu_native.pair_order(codes)
    assert paired.shape == (codes.shape[0], 16, 32) and paired.dtype == torch.uint8
    for p, c, i in [(0, 0, 0), (0, 0, 1), (1, 3, 17), (3, 15, 31), (2, 7, 6)]:
        for half, r in ((0, 2 * c), (1, 2 * c + 1)):
            assert (int(paired[p, c, i]) >> (4 * half)) & 15 == int(q[p, 2 * r + i % 2, i // 2])


@pytest.mark.parametrize("m", [6, 7, 16])
def test_a_decode_step_takes_bf16_products_from_7_rows(m):
    """In a step of decode rows alone (the runner sets bf16_from_rows) 7 rows take the tiles; fewer stay fp32."""
    cols, rows = 8 * BY_NAME["Q4_1"].block, 40
    raw = random_raw("Q4_1", rows, cols, seed=2)
    codes, scales, offsets, layout = cpu_native.pack(torch.from_numpy(raw), BY_NAME["Q4_1"], cols)
    x = torch.randn(m, cols, generator=torch.Generator().manual_seed(m))
    fp32 = cpu_native.matmul(x, codes, scales, offsets, layout, rows)
    bf16 = dataclasses.replace(layout, bf16=True)
    assert torch.equal(cpu_native.matmul(x, codes, scales, offsets, bf16, rows), fp32)  # any other step: from 17
    token = cpu_native.bf16_from_rows.set(cpu_native.BF16_FROM_ROWS_DECODE)
    try:
        ours = cpu_native.matmul(x, codes, scales, offsets, bf16, rows)
    finally:
        cpu_native.bf16_from_rows.reset(token)
    if m < 7 or not amx_cpu():
        assert torch.equal(ours, fp32)
        return
    ref = x.bfloat16().double() @ gguf_dequant(raw, "Q4_1").bfloat16().double().T
    torch.testing.assert_close(ours.double(), ref, atol=1e-5 * ref.abs().max().item(), rtol=1e-5)
    assert not torch.equal(ours, fp32)


@pytest.mark.parametrize("name", ["Q4_1", "Q8_0", "Q4_K", "Q6_K"])
def test_bf16_products_do_not_depend_on_the_rows_beside(name):
    """A row's bf16 products have the same bits whatever the step's other rows: up to 32 rows the kernel decodes
    32 k's at a time between tile products, past 32 each panel once for all rows (cpu_amx.c)."""
    block = BY_NAME[name].block
    cols, rows = block * max(2, 256 // block), 70  # 8 or more blocks of 32 k: sums whose order shows
    raw = random_raw(name, rows, cols, seed=4)
    codes, scales, offsets, layout = cpu_native.pack(torch.from_numpy(raw), BY_NAME[name], cols)
    layout = dataclasses.replace(layout, bf16=True)
    x = torch.randn(100, cols, generator=torch.Generator().manual_seed(5))
    whole = cpu_native.matmul(x, codes, scales, offsets, layout, rows)
    for m in (17, 31, 32, 33, 64):
        assert torch.equal(cpu_native.matmul(x[:m], codes, scales, offsets, layout, rows), whole[:m]), m
        tail = x[100 - m:]
        assert torch.equal(cpu_native.matmul(tail, codes, scales, offsets, layout, rows), whole[100 - m:]), m


def test_a_bfloat16_engine_on_the_cpu(tiny_gguf):
    """dtype bfloat16 on a GGUF: fp32 modules and cache, every step in the one-call C loop; a lone sequence (a
    12-token prompt, then one row a step) and 20 prompts at once stay within bf16's rounding of the fp32 engine,
    through the 4-bit layers' bf16 products on AMX even alone; without AMX a lone sequence is the fp32 engine's."""
    path, _ = tiny_gguf("llama")
    bf16 = LLM(str(path), dtype="bfloat16", block_size=8)
    fp32 = LLM(str(path), dtype="float32", block_size=8)
    engine = bf16.engine
    assert engine.bf16_products and engine.dtype == torch.float32 and engine.runner.cpu_decoder is not None
    paired = [m.layout.pairs_order for m in engine.model.modules() if getattr(m, "layout", None) is not None]
    assert any(paired) == amx_cpu() and not all(paired)  # 4-bit codes in the tiles' order; 8-bit ones not
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0)
    alone = prompts_of_lengths(12)
    if not amx_cpu():
        assert bf16.generate(alone, greedy)[0].outputs[0].token_ids == \
            fp32.generate(alone, greedy)[0].outputs[0].token_ids

    first = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, logprobs=0)
    for prompts in (alone, prompts_of_lengths(*range(5, 25))):
        ours = [o.outputs[0].logprobs[0] for o in bf16.generate(prompts, first)]
        theirs = [o.outputs[0].logprobs[0] for o in fp32.generate(prompts, first)]
        assert [list(a) for a in ours] == [list(b) for b in theirs]  # the same greedy tokens (none is a near tie)
        gaps = [abs(next(iter(a.values())).logprob - next(iter(b.values())).logprob) for a, b in zip(ours, theirs)]
        assert max(gaps) < 0.15  # a random model's logits through bf16 products: measured up to 0.1
        assert (max(gaps) > 0) == amx_cpu()


EIGHT_BIT = {"token_embd": "Q8_0", "output": "Q6_K", "attn_q": "Q8_0", "attn_k": "Q5_1", "attn_v": "Q8_0",
             "attn_output": "Q5_0", "ffn_gate": "Q8_0", "ffn_up": "Q6_K", "ffn_down": "Q5_0"}


def test_a_bfloat16_engine_decoding_7_sequences_takes_the_tiles(tiny_gguf):
    """8-bit codes: a step of 7 sequences' decode tokens (here one-token prompts) multiplies in bf16 on AMX, in the
    one-call loop and the output layer; 6 stay the fp32 engine's bits. With 4-bit layers too, a lone sequence's
    verification runs of up to 16 rows keep its plain decoding's bits."""
    path, _ = tiny_gguf("llama", "eight-bit", policy=EIGHT_BIT)
    bf16 = LLM(str(path), dtype="bfloat16", block_size=8)
    fp32 = LLM(str(path), dtype="float32", block_size=8)
    first = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, logprobs=0)
    for n in (6, 7):
        prompts = [[t] for t in range(3, 3 + n)]
        ours = [o.outputs[0].logprobs[0] for o in bf16.generate(prompts, first)]
        theirs = [o.outputs[0].logprobs[0] for o in fp32.generate(prompts, first)]
        assert [list(a) for a in ours] == [list(b) for b in theirs]
        gaps = [abs(next(iter(a.values())).logprob - next(iter(b.values())).logprob) for a, b in zip(ours, theirs)]
        assert (max(gaps) > 0) == (n == 7 and amx_cpu()), n
    path, _ = tiny_gguf("llama")
    spec = LLM(str(path), dtype="bfloat16", block_size=8,
               speculative={"method": "ngram", "num_tokens": 15, "prompt_lookup_min": 1})
    plain = LLM(str(path), dtype="bfloat16", block_size=8)
    greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=0)
    repeating = [prompts_of_lengths(30)[0] * 2]  # the n-gram lookup finds its drafts
    ours, theirs = spec.generate(repeating, greedy)[0].outputs[0], plain.generate(repeating, greedy)[0].outputs[0]
    assert ours.token_ids == theirs.token_ids and ours.logprobs == theirs.logprobs  # the same bits
    stats = spec.engine.stats()  # some runs of 7 rows or more (6 drafts a run on average, or more)
    assert stats["spec_draft_tokens"] >= 6 * stats["spec_verifications"] > 0


def test_bfloat16_is_bf16_modules_for_a_gguf_without_quantized_layers(tiny_gguf):
    """An F16 GGUF has no blocks for our kernels: bfloat16 stays PyTorch's bf16 modules (half the memory of fp32)."""
    kinds = ("token_embd", "output", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
    path, _ = tiny_gguf("llama", "f16", policy=dict.fromkeys(kinds, "F16"))
    engine = LLM(str(path), dtype="bfloat16", block_size=8).engine
    assert not engine.bf16_products and engine.dtype == torch.bfloat16
    floats = {n: t for n, t in [*engine.model.named_parameters(), *engine.model.named_buffers()]
              if t.is_floating_point() and n != "cos_sin"}  # the rotary table is fp32 in every dtype
    assert floats and all(t.dtype == torch.bfloat16 for t in floats.values())

