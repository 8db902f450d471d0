"""gpt-oss's experts kept in GGUF blocks (MXFP4, and K-quants beside it): the biases on gate|up and down and the
clamped SwiGLU in the per-expert loop, the one C call of a decode step (cpu_moe.c) and the fused Triton kernels
(interpreter), each against moe_torch.fused_moe over the same experts dequantized by gguf-py."""

import pytest
import torch

from backend.kernels import native
from backend.kernels.moe_torch import fused_moe, route
from backend.quant import experts as experts_module
from tests.backend.conftest import KERNEL_DEVICE, count_c_calls, interpreted_only
from tests.backend.test_quant_moe import INTER, E, H, experts, per_expert_loop

FORMATS = [("MXFP4", "MXFP4", "MXFP4"), ("Q8_0", "Q4_K", "MXFP4")]
CLAMP = (1.702, 1.0)  # a limit most of these activations cross, so that the clamp counts


def case(formats, tokens: int, seed: int = 0):
    module, w_gate_up, w_down = experts(formats)
    g = torch.Generator().manual_seed(seed + tokens)
    biases = (torch.randn(E, 2 * INTER, generator=g), torch.randn(E, H, generator=g))
    x = torch.randn(tokens, H, generator=g)
    weights, ids = route(torch.randn(tokens, E, generator=g), 2, True)
    ref = fused_moe(x, w_gate_up, w_down, weights, ids, *biases, CLAMP)
    # what a kernel that dropped the biases or the clamp would give: far from ref
    for wrong in (
        fused_moe(x, w_gate_up, w_down, weights, ids, None, None, CLAMP),
        fused_moe(x, w_gate_up, w_down, weights, ids, *biases, None),
    ):
        assert (wrong - ref).abs().max() > 0.1 * ref.abs().max()
    return module, x, weights, ids, biases, ref, (w_gate_up, w_down)


def close(out, ref):
    torch.testing.assert_close(out, ref, atol=1e-5 * ref.abs().max().item(), rtol=1e-4)


@pytest.mark.parametrize("formats", FORMATS)
def test_the_per_expert_loop_adds_the_biases_and_clamps(formats, monkeypatch):
    monkeypatch.setattr(native, "enabled", lambda: False)
    module, x, weights, ids, biases, ref, _ = case(formats, 7)
    close(module(x, weights, ids, biases=biases, clamped_swiglu=CLAMP), ref)


@pytest.mark.skipif(native.library() is None, reason="no C compiler for the CPU kernels")
@pytest.mark.parametrize("products", ["float32", "int8"])
@pytest.mark.parametrize("formats", FORMATS)
def test_a_decode_steps_biased_experts_go_through_one_c_call(formats, products, monkeypatch):
    """Packed for our CPU kernels, a few tokens' experts are one moe_tokens_biased call whose result is the
    loop's (the same matmuls: fp32 panels, or 8-bit activations in quads) and, in fp32, the float reference's."""
    module, x, weights, ids, biases, ref, dense = case(formats, 5, seed=products == "int8")
    for w in module.weights():
        w.pack_for_cpu(products)
    loop = per_expert_loop(module, x, weights, ids, biases=biases, clamped_swiglu=CLAMP)
    monkeypatch.setattr(experts_module, "FEW_TOKENS", 64)
    monkeypatch.setattr(experts_module, "FEW_TOKENS_NARROW", 64)
    calls = count_c_calls(monkeypatch, "moe_tokens_biased")
    one_call = module(x, weights, ids, biases=biases, clamped_swiglu=CLAMP)
    assert calls == [5]
    close(one_call, loop)
    if products == "float32":
        close(one_call, ref)
        # the biases without the clamp: plain SiLU
        close(module(x, weights, ids, biases=biases), fused_moe(x, *dense, weights, ids, *biases))
        assert calls == [5, 5]


@pytest.mark.skipif(native.library() is None, reason="no C compiler for the CPU kernels")
@pytest.mark.parametrize("products", ["float32", "int8"])
def test_a_prompts_biased_experts_go_through_the_call_in_blocks(products, monkeypatch):
    """Stacks the 8-bit kernel reads take a prompt's tokens through moe_tokens_biased calls of up to PROMPT_TOKENS
    tokens: the loop's result (whose sigmoid is torch's), and in fp32 (digits) the float reference's."""
    module, x, weights, ids, biases, ref, _ = case(FORMATS[1], 150, seed=3)
    for w in module.weights():
        w.pack_for_cpu(products)
    if module.gate.layout.order not in ("quads", "digits"):
        pytest.skip("an fp32 engine's stacks are the fp32 kernel's panels in this build (no VNNI)")
    loop = per_expert_loop(module, x, weights, ids, biases=biases, clamped_swiglu=CLAMP)
    monkeypatch.setattr(experts_module, "PROMPT_TOKENS", 64)
    calls = count_c_calls(monkeypatch, "moe_tokens_biased")
    close(module(x, weights, ids, biases=biases, clamped_swiglu=CLAMP), loop)  # torch's sigmoid in the loop
    assert calls == [64, 64, 22]
    if products == "float32":
        close(loop, ref)


@interpreted_only
@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("formats", FORMATS)
@pytest.mark.parametrize("tokens", [1, 9])
def test_the_triton_moe_adds_the_biases_and_clamps(formats, tokens, monkeypatch):
    """One token takes the per-pair block GEMV, nine the grouped GEMM; MXFP4 read as stored in both (fp32)."""
    module, x, weights, ids, biases, ref, _ = case(formats, tokens)
    module.to(KERNEL_DEVICE)
    monkeypatch.setenv("SCRIPTORIUM_TRITON", "1")
    out = module(
        x.to(KERNEL_DEVICE),
        weights.to(KERNEL_DEVICE),
        ids.to(KERNEL_DEVICE),
        biases=tuple(b.to(KERNEL_DEVICE) for b in biases),
        clamped_swiglu=CLAMP,
    )
    close(out.cpu(), ref)
