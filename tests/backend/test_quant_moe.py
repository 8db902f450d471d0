"""MoE over quantized experts: the fused Triton kernels (interpreter), the CPU paths and offloading, against
the float experts' fused_moe on the same weights dequantized."""

import pytest
import torch

from backend.kernels import native
from backend.kernels.moe import fused_moe, route
from backend.quant import cpu_native
from backend.quant import experts as experts_module
from backend.quant.experts import QuantExperts
from backend.quant.formats import BY_NAME
from backend.quant.modules import QuantWeight
from tests.backend.quant_blocks import gguf_dequant, random_raw

E, H, INTER, TOP_K = 4, 256, 256, 2


def experts(formats: tuple[str, str, str]):
    weights, dense = [], []
    for i, (name, rows, cols) in enumerate(zip(formats, (INTER, INTER, H), (H, H, INTER))):
        raw = random_raw(name, rows, cols, seed=10 + i, lead=(E,))
        w = QuantWeight(BY_NAME[name], rows, cols, lead=(E,), device="cpu")
        w.data.copy_(torch.from_numpy(raw))
        weights.append(w)
        dense.append(gguf_dequant(raw, name))
    return QuantExperts(*weights), torch.cat([dense[0], dense[1]], dim=1), dense[2]


def routed(tokens: int):
    g = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, H, generator=g)
    weights, ids = route(torch.randn(tokens, E, generator=g), TOP_K, True)
    return x, weights, ids


@pytest.mark.parametrize("formats", [("Q4_K", "Q4_K", "Q6_K"), ("Q8_0", "Q5_1", "Q4_0")])
@pytest.mark.parametrize("tokens", [1, 7])
def test_quantized_experts_match_float_experts(formats, tokens, monkeypatch):
    module, w_gate_up, w_down = experts(formats)
    x, weights, ids = routed(tokens)
    ref = fused_moe(x, w_gate_up, w_down, weights, ids)
    tol = dict(atol=1e-5 * ref.abs().max().item(), rtol=1e-4)
    torch.testing.assert_close(module(x, weights, ids), ref, **tol)  # reference: dequantize each expert
    monkeypatch.setenv("SCRIPTORIUM_TRITON", "1")
    torch.testing.assert_close(module(x, weights, ids), ref, **tol)  # the fused kernels
    monkeypatch.delenv("SCRIPTORIUM_TRITON")
    for w in module.weights():
        w.pack_for_cpu()
    torch.testing.assert_close(module(x, weights, ids), ref, **tol)  # the CPU kernel


def test_a_float_stack_among_quantized_ones_runs_in_the_fused_kernels(monkeypatch):
    module, w_gate_up, w_down = experts(("Q4_K", "Q4_K", "Q6_K"))
    dense = QuantWeight(None, H, INTER, lead=(E,), device="cpu")
    dense.data.copy_(w_down)
    module.down = dense
    x, weights, ids = routed(5)
    monkeypatch.setenv("SCRIPTORIUM_TRITON", "1")
    torch.testing.assert_close(module(x, weights, ids), fused_moe(x, w_gate_up, w_down, weights, ids),
                               atol=1e-4, rtol=1e-4)


@pytest.mark.skipif(native.library() is None, reason="no C compiler for the CPU kernels")
@pytest.mark.parametrize("formats", [("Q4_K", "Q4_K", "Q6_K"), ("Q8_0", "Q5_1", "Q4_0")])
def test_a_few_tokens_experts_in_one_call_are_the_loops_bits(formats, c_kernels, monkeypatch):
    """A decode batch's experts go through one C call (cpu_moe.c), a prompt chunk's through the per-expert loop:
    each token gets the loop's bits, alone or beside others (a decode step and a draft's verification rows agree,
    speculation stays exact), with experts meeting 1 to 40 rows (chunks of 16), and the call is really taken."""
    module, _, _ = experts(formats)
    for w in module.weights():
        w.pack_for_cpu()
    g = torch.Generator().manual_seed(6)
    x = torch.randn(60, H, generator=g)
    weights, ids = route(torch.randn(60, E, generator=g), 3, True)  # three terms a token: their order shows
    monkeypatch.setattr(experts_module, "FEW_TOKENS", 0)
    monkeypatch.setattr(experts_module, "FEW_TOKENS_NARROW", 0)
    loop = module(x, weights, ids)
    monkeypatch.setattr(experts_module, "FEW_TOKENS", 64)
    monkeypatch.setattr(experts_module, "FEW_TOKENS_NARROW", 64)  # 4-row tiles (AVX2, portable) take the call too
    calls = []
    lib = native.library()

    class Spy:
        def __getattr__(self, name):
            return getattr(lib, name)

        def moe_tokens(self, *args):
            calls.append(args[1])
            return lib.moe_tokens(*args)

    monkeypatch.setattr(native, "library", Spy)
    for rows in (slice(0, 60), slice(3, 5), slice(7, 8), slice(10, 23)):
        assert torch.equal(module(x[rows], weights[rows], ids[rows]), loop[rows]), rows
    assert calls == [60, 2, 1, 13]
    # as shipped: where a tile meets 4 rows, steps of more than 16 tokens take the loop (it decodes weights once)
    monkeypatch.setattr(experts_module, "FEW_TOKENS_NARROW", 16)
    calls.clear()
    for rows in (slice(0, 20), slice(20, 36)):
        assert torch.equal(module(x[rows], weights[rows], ids[rows]), loop[rows]), rows
    assert calls == ([20, 16] if c_kernels == "native" and native.tile_rows() == 16 else [16])
    with pytest.raises(IndexError, match="an expert id outside this layer's 4 experts"):
        module(x[:2], weights[:2], torch.tensor([[0, 1, 2], [1, 3, 4]]))


def bf16_experts(tokens: int, seed: int):
    """Experts of 8-bit codes packed for bf16 products (4-bit ones take the tiles' order on AMX, and the loop:
    test_4_bit_experts_in_the_tiles_order_take_the_loop), and `tokens` random tokens routed top-2 to them."""
    module, _, _ = experts(("Q8_0", "Q5_1", "Q6_K"))
    for w in module.weights():
        w.pack_for_cpu(bf16=True)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, H, generator=g)
    return module, x, *route(torch.randn(tokens, E, generator=g), 2, True)


@pytest.mark.skipif(native.library() is None, reason="no C compiler for the CPU kernels")
def test_bf16_products_keep_the_loops_bits_for_moe(monkeypatch):
    """With bf16 products a matmul of more than 16 rows takes AMX tiles (where the CPU has them), which the one-call
    path does not: steps of more than 16 tokens take the loop, fewer the call, both the loop's bits."""
    module, x, weights, ids = bf16_experts(40, seed=8)  # 20 rows an expert on average
    monkeypatch.setattr(experts_module, "FEW_TOKENS", 0)
    monkeypatch.setattr(experts_module, "FEW_TOKENS_BF16", 0)
    loop = [module(x, weights, ids), module(x[:16], weights[:16], ids[:16])]
    monkeypatch.setattr(experts_module, "FEW_TOKENS", 64)
    monkeypatch.setattr(experts_module, "FEW_TOKENS_BF16", 16)
    assert torch.equal(module(x, weights, ids), loop[0])
    assert torch.equal(module(x[:16], weights[:16], ids[:16]), loop[1])


@pytest.mark.skipif(native.library() is None, reason="no C compiler for the CPU kernels")
def test_bf16_products_in_a_decode_step_keep_the_loops_bits_for_moe(monkeypatch):
    """In a step of decode rows alone the loop's matmuls take AMX tiles from 7 rows (cpu_native.bf16_from_rows): the
    call takes only tokens whose experts each meet fewer, and every token gets the loop's bits; no tokens, and bad
    expert ids (the call's IndexError), as without bf16 products."""
    module, x, weights, ids = bf16_experts(16, seed=3)  # 8 rows an expert on average
    spread = torch.arange(6).remainder(E).view(3, 2)  # 3 tokens: no expert meets more than 2 rows
    token = cpu_native.bf16_from_rows.set(cpu_native.BF16_FROM_ROWS_DECODE)
    try:
        monkeypatch.setattr(experts_module, "FEW_TOKENS_BF16", 0)
        loop = [module(x, weights, ids), module(x[:3], weights[:3], spread)]
        monkeypatch.setattr(experts_module, "FEW_TOKENS_BF16", 16)
        calls = []
        call = experts_module.QuantExperts._few_tokens
        monkeypatch.setattr(experts_module.QuantExperts, "_few_tokens",
                            lambda self, *a: calls.append(a[0].shape[0]) or call(self, *a))
        assert torch.equal(module(x, weights, ids), loop[0])
        assert torch.equal(module(x[:3], weights[:3], spread), loop[1])
    finally:
        cpu_native.bf16_from_rows.reset(token)
    # the 16 tokens' experts met 7 rows or more: the loop, where AMX would take them (elsewhere all is fp32)
    assert calls == ([3] if native.amx() else [16, 3])
    assert module(x[:0], weights[:0], ids[:0]).shape == (0, H)
    with pytest.raises(IndexError, match="an expert id outside"):
        module(x[:2], weights[:2], torch.tensor([[0, -1], [1, 2]]))


@pytest.mark.skipif(native.library() is None or not native.amx(), reason="codes in the tiles' order are for AMX only")
def test_4_bit_experts_in_the_tiles_order_take_the_loop(monkeypatch):
    """4-bit experts of a bf16 engine on AMX keep their codes in the tiles' order, which the one C call cannot read:
    every step takes the loop, whose bf16 products stay within bf16's rounding of the float experts."""
    module, w_gate_up, w_down = experts(("Q4_K", "Q4_0", "Q4_1"))
    for w in module.weights():
        w.pack_for_cpu(bf16=True)
    assert all(w.layout.pairs_order for w in module.weights())
    calls = []
    monkeypatch.setattr(experts_module.QuantExperts, "_few_tokens", lambda self, *a: calls.append(1))
    for tokens in (1, 7, 40):
        x, weights, ids = routed(tokens)
        ref = fused_moe(x.bfloat16().float(), w_gate_up, w_down, weights, ids)
        torch.testing.assert_close(module(x, weights, ids), ref, atol=5e-3 * ref.abs().max().item(), rtol=0)  # measured 2.5e-3
    assert calls == []
