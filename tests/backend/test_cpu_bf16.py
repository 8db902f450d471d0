"""bfloat16 on the CPU for a GGUF kept in its blocks: fp32 around the matmuls, and products in bf16 on AMX tiles
(backend/quant/cpu_amx.c) where the CPU has AMX, for matmuls of more than 16 rows, or of 7 or more in a step of
decode rows alone (cpu_native.bf16_from_rows); fp32 below that and without."""

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
    """dtype bfloat16 on a GGUF: fp32 modules and cache, every step in the one-call C loop; a lone sequence's
    steps (1 row, or a 12-token prompt) are the fp32 engine's bits; 20 prompts at once go through the bf16
    products (on AMX) and stay within bf16's rounding of the fp32 engine."""
    path, _ = tiny_gguf("llama")
    bf16 = LLM(str(path), dtype="bfloat16", block_size=8)
    fp32 = LLM(str(path), dtype="float32", block_size=8)
    engine = bf16.engine
    assert engine.bf16_products and engine.dtype == torch.float32 and engine.runner.cpu_decoder is not None
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0)
    alone = prompts_of_lengths(12)
    assert bf16.generate(alone, greedy)[0].outputs[0].token_ids == fp32.generate(alone, greedy)[0].outputs[0].token_ids

    first = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, logprobs=0)
    prompts = prompts_of_lengths(*range(5, 25))
    ours = [o.outputs[0].logprobs[0] for o in bf16.generate(prompts, first)]
    theirs = [o.outputs[0].logprobs[0] for o in fp32.generate(prompts, first)]
    assert [list(a) for a in ours] == [list(b) for b in theirs]  # the same greedy tokens (none is a near tie)
    gaps = [abs(next(iter(a.values())).logprob - next(iter(b.values())).logprob) for a, b in zip(ours, theirs)]
    assert max(gaps) < 0.15  # a random model's logits through bf16 products: measured up to 0.1
    assert (max(gaps) > 0) == amx_cpu()


def test_a_bfloat16_engine_decoding_7_sequences_takes_the_tiles(tiny_gguf):
    """A step of 7 sequences' decode tokens (here one-token prompts) multiplies in bf16 on AMX, in the one-call
    loop and the output layer; 6 stay the fp32 engine's bits, and a lone sequence's verification runs of up to 16
    rows keep its plain decoding's."""
    path, _ = tiny_gguf("llama")
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
    spec = LLM(str(path), dtype="bfloat16", block_size=8,
               speculative={"method": "ngram", "num_tokens": 15, "prompt_lookup_min": 1})
    greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=0)
    repeating = [prompts_of_lengths(30)[0] * 2]  # the n-gram lookup finds its drafts
    ours, plain = spec.generate(repeating, greedy)[0].outputs[0], bf16.generate(repeating, greedy)[0].outputs[0]
    assert ours.token_ids == plain.token_ids and ours.logprobs == plain.logprobs  # the same bits
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

