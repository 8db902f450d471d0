"""MoE over quantized experts: the fused Triton kernels (interpreter), the CPU paths and offloading, against
the float experts' fused_moe on the same weights dequantized."""

import pytest
import torch

from backend.kernels import native
from backend.kernels.moe_torch import add_shared, fused_moe, route, route_rows
from backend.quant import experts as experts_module
from backend.quant.experts import QuantExperts
from backend.quant.formats import BY_NAME
from backend.quant.modules import QuantWeight
from tests.backend.conftest import count_c_calls, fp32_order, interpreted_only
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


def per_expert_loop(module: QuantExperts, *args, **kwargs) -> torch.Tensor:
    """module's result from the per-expert loop, whatever C call it would take."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(QuantExperts, "_call_takes", lambda self, x: False)
        return module(*args, **kwargs)


def routed(tokens: int):
    g = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, H, generator=g)
    weights, ids = route(torch.randn(tokens, E, generator=g), TOP_K, True)
    return x, weights, ids


@interpreted_only
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


@interpreted_only
def test_a_float_stack_among_quantized_ones_runs_in_the_fused_kernels(monkeypatch):
    module, w_gate_up, w_down = experts(("Q4_K", "Q4_K", "Q6_K"))
    dense = QuantWeight(None, H, INTER, lead=(E,), device="cpu")
    dense.data.copy_(w_down)
    module.down = dense
    x, weights, ids = routed(5)
    monkeypatch.setenv("SCRIPTORIUM_TRITON", "1")
    torch.testing.assert_close(
        module(x, weights, ids), fused_moe(x, w_gate_up, w_down, weights, ids), atol=1e-4, rtol=1e-4
    )


@pytest.mark.skipif(native.library() is None, reason="no C compiler for the CPU kernels")
@pytest.mark.parametrize("products", ["float32", "int8"])
@pytest.mark.parametrize("formats", [("Q4_K", "Q4_K", "Q6_K"), ("Q8_0", "Q5_1", "Q4_0")])
def test_a_few_tokens_experts_in_one_call_are_the_loops_bits(formats, products, c_kernels, monkeypatch):
    """A decode batch's experts go through one C call (cpu_moe.c), a prompt chunk's through the per-expert loop:
    each token gets the loop's bits, alone or beside others (a decode step and a draft's verification rows agree,
    speculation stays exact), with experts meeting 1 to 40 rows (chunks of 16), and the call is really taken. With
    8-bit activations (quad order: x quantized once per token for gate and up, shared where their groups agree,
    each pair's activations for down) the loop is the 8-bit kernel's matmuls."""
    module, _, _ = experts(formats)
    for w in module.weights():
        w.pack_for_cpu(products)
        assert w.layout.order == ("quads" if products == "int8" else fp32_order())
    g = torch.Generator().manual_seed(6)
    x = torch.randn(60, H, generator=g)
    weights, ids = route(torch.randn(60, E, generator=g), 3, True)  # three terms a token: their order shows
    loop = per_expert_loop(module, x, weights, ids)
    monkeypatch.setattr(experts_module, "FEW_TOKENS", 64)
    monkeypatch.setattr(
        experts_module, "FEW_TOKENS_NARROW", 64
    )  # 4-row tiles (AVX2, portable) take the call too
    calls = count_c_calls(monkeypatch, "moe_tokens")
    for rows in (slice(0, 60), slice(3, 5), slice(7, 8), slice(10, 23)):
        assert torch.equal(module(x[rows], weights[rows], ids[rows]), loop[rows]), rows
    assert calls == [60, 2, 1, 13]
    # as shipped: where a tile meets 4 rows, steps of more than 16 tokens take the loop (it decodes weights once),
    # unless the 8-bit kernel reads the stacks (quads, digits), which takes a prompt's tokens too
    monkeypatch.setattr(experts_module, "FEW_TOKENS_NARROW", 16)
    calls.clear()
    for rows in (slice(0, 20), slice(20, 36)):
        assert torch.equal(module(x[rows], weights[rows], ids[rows]), loop[rows]), rows
    wide = (c_kernels == "native" and native.tile_rows() == 16) or module.gate.layout.order in (
        "quads",
        "digits",
    )
    assert calls == ([20, 16] if wide else [16])
    with pytest.raises(IndexError, match="an expert id outside this layer's 4 experts"):
        module(x[:2], weights[:2], torch.tensor([[0, 1, 2], [1, 3, 4]]))


@pytest.mark.skipif(native.library() is None, reason="no C compiler for the CPU kernels")
@pytest.mark.parametrize("products", ["float32", "int8"])
@pytest.mark.parametrize("formats", [("IQ4_XS", "IQ3_XXS", "IQ3_S"), ("Q4_K", "IQ4_NL", "Q6_K")])
def test_a_prompts_experts_go_through_the_call_in_blocks(formats, products, c_kernels, monkeypatch):
    """Stacks the 8-bit kernel reads (quads; an fp32 engine's digits where the build has VNNI) take a prompt's
    tokens through C calls of up to PROMPT_TOKENS tokens, experts meeting up to 100 rows a call (chunks of 64, so
    an expert's panel meets several): the loop's bits with 1, 2 or 3 threads sharing the jobs, and the float64 MoE
    of gguf-py's weights within fp32's rounding (8-bit x: its own)."""
    module = experts(formats)[0]
    dense = [
        gguf_dequant(random_raw(name, rows, cols, seed=10 + i, lead=(E,)), name).double()
        for i, (name, rows, cols) in enumerate(zip(formats, (INTER, INTER, H), (H, H, INTER)))
    ]
    for w in module.weights():
        w.pack_for_cpu(products)
    if module.gate.layout.order not in ("quads", "digits"):
        pytest.skip("an fp32 engine's stacks are the fp32 kernel's panels in this build (no VNNI)")
    g = torch.Generator().manual_seed(9)
    x = torch.randn(300, H, generator=g)
    weights, ids = route(torch.randn(300, E, generator=g), 3, True)
    loop = per_expert_loop(module, x, weights, ids)
    monkeypatch.setattr(experts_module, "PROMPT_TOKENS", 128)
    calls = count_c_calls(monkeypatch, "moe_tokens")
    threads = torch.get_num_threads()
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            assert torch.equal(module(x, weights, ids), loop), n
    finally:
        torch.set_num_threads(threads)
    assert calls == [128, 128, 44] * 3
    ref = fused_moe(x.double(), torch.cat(dense[:2], dim=1), dense[2], weights.double(), ids)
    tol = 2e-2 if products == "int8" else 1e-5
    assert (loop.double() - ref).abs().max() <= tol * ref.abs().max()


@pytest.mark.skipif(native.library() is None, reason="no C compiler for the CPU kernels")
def test_a_bf16_engines_experts_stay_fp32_in_one_call(monkeypatch):
    """A bf16 engine's expert stacks keep the fp32 kernel's layout (its one C call beats the per-expert loop), while
    a plain weight beside them takes the tiles' order on AMX: the call still runs, with the fp32 engine's bits."""
    module, _, _ = experts(("Q4_K", "Q8_0", "Q6_K"))
    fp32, _, _ = experts(("Q4_K", "Q8_0", "Q6_K"))
    for w, v in zip(module.weights(), fp32.weights()):
        w.pack_for_cpu("bfloat16")
        v.pack_for_cpu()
        assert w.layout == v.layout and w.layout.order == fp32_order()
    single = QuantWeight(BY_NAME["Q4_K"], 64, H, device="cpu")
    single.data.copy_(torch.from_numpy(random_raw("Q4_K", 64, H, seed=1)))
    single.pack_for_cpu("bfloat16")
    assert (single.layout.order == "pairs") == native.amx()
    calls = []
    call = experts_module.QuantExperts._one_call
    monkeypatch.setattr(
        experts_module.QuantExperts, "_one_call", lambda self, *a: calls.append(1) or call(self, *a)
    )
    x, weights, ids = routed(7)
    assert torch.equal(module(x, weights, ids), fp32(x, weights, ids)) and len(calls) == 2


@pytest.mark.skipif(native.library() is None, reason="no C compiler for the CPU kernels")
@pytest.mark.parametrize(
    "experts, top_k, renormalize", [(8, 2, True), (32, 8, True), (60, 4, False), (5, 5, True)]
)
def test_the_c_router_chooses_the_experts_torch_chooses(experts, top_k, renormalize):
    """route_rows (cpu_moe.c's moe_route_rows, the one-call step's router) against route() over torch's logits:
    the same experts in the same order, the same weights to float rounding, each row's independent of the rows
    beside it."""
    g = torch.Generator().manual_seed(experts)
    gate = torch.nn.Linear(200, experts, bias=False)  # a hidden size with a tail past the vector lanes
    gate.weight.data = torch.randn(experts, 200, generator=g) / 10
    x = torch.randn(9, 200, generator=g)
    weights, ids = route_rows(x, gate, top_k, renormalize)
    want_weights, want_ids = route(gate(x), top_k, renormalize)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(weights, want_weights, atol=1e-6, rtol=1e-5)
    if renormalize:
        torch.testing.assert_close(weights.sum(dim=1), torch.ones(9))
    for row in (0, 4, 8):
        alone = route_rows(x[row : row + 1].contiguous(), gate, top_k, renormalize)
        assert torch.equal(alone[0], weights[row : row + 1]) and torch.equal(alone[1], ids[row : row + 1])


@pytest.mark.skipif(native.library() is None, reason="no C compiler for the CPU kernels")
def test_the_c_router_breaks_ties_by_the_lower_expert():
    gate = torch.nn.Linear(16, 6, bias=False)
    gate.weight.data = torch.tensor([[1.0] * 16, [2.0] * 16, [2.0] * 16, [0.0] * 16, [2.0] * 16, [1.0] * 16])
    weights, ids = route_rows(torch.ones(1, 16), gate, 4, False)
    assert ids.tolist() == [[1, 2, 4, 0]]
    assert weights[0, 0] == weights[0, 1] == weights[0, 2] > weights[0, 3]


@pytest.mark.skipif(native.library() is None, reason="no C compiler for the CPU kernels")
def test_the_shared_expert_is_added_as_torch_adds_it():
    """add_shared (cpu_moe.c's moe_add_shared_rows, the one-call step's) against Qwen2-MoE's formula in torch:
    out + sigmoid(x . gate) * shared, to float rounding, in place."""
    g = torch.Generator().manual_seed(3)
    x, shared, out = (torch.randn(5, 200, generator=g) for _ in range(3))
    gate = torch.nn.Linear(200, 1, bias=False)
    gate.weight.data = torch.randn(1, 200, generator=g) / 5
    want = out + torch.sigmoid(gate(x)) * shared
    got = add_shared(out.clone(), x, gate, shared)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    assert not torch.equal(got, out)
