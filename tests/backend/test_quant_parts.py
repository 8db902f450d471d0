"""A fused layer's parts (q|k|v, gate|up, each in its own format) and the linear-attention layer's two input projections
multiply their one input in one C call (cpu_parts.py): in quad order (8-bit activations, or an exact engine's x in
three 8-bit digits) x is quantized once for the parts that read it alike, and each part's columns are the bits a
matmul of its own gives, with no torch.cat."""

import pytest
import torch

from backend import LLM, SamplingParams
from backend.kernels import native
from backend.models import gated_deltanet
from backend.quant.formats import BY_NAME
from backend.quant.modules import QuantLinear, QuantWeight
from tests.backend.conftest import count_c_calls
from tests.backend.quant_blocks import random_raw
from tests.backend.tiny_gguf_qwen3_next import write_gguf

pytestmark = pytest.mark.skipif(native.library() is None, reason="no C compiler for the CPU kernels")

COLS = 256


def weight(fmt: str | None, rows: int, seed: int, products: str) -> QuantWeight:
    """A [rows, COLS] weight of random blocks of fmt (None: plain floats), repacked for the products' kernel."""
    w = QuantWeight(BY_NAME[fmt] if fmt else None, rows, COLS, device="cpu")
    if fmt is None:
        w.data.copy_(torch.randn(rows, COLS, generator=torch.Generator().manual_seed(seed)))
    else:
        w.data.copy_(torch.from_numpy(random_raw(fmt, rows, COLS, seed=seed)))
        w.pack_for_cpu(products)
    return w


def each_alone(linear: QuantLinear, x: torch.Tensor) -> torch.Tensor:
    """The layer's y with a matmul a part, each quantizing x for itself, then concatenated (before the fused call)."""
    y = torch.cat([p.matmul(x) for p in linear.parts], dim=-1)
    return y if linear.bias is None else y + linear.bias


@pytest.mark.parametrize(
    "formats",
    [
        ("IQ4_NL", "IQ4_NL", "IQ4_NL"),
        ("Q4_K", "Q4_K", "Q6_K"),
        ("IQ4_XS", "Q5_K", "Q8_0"),
        ("Q4_K", None, "Q6_K"),
    ],
    ids=["one-format", "q4_k_m-mix", "three-kinds", "a-float-part"],
)
@pytest.mark.parametrize("products", ["int8", "float32"])
def test_a_fused_layer_is_one_call_with_each_parts_bits(formats, products, c_kernels, monkeypatch):
    """q|k|v of 72 + 40 + 40 rows (panels of 16 and a part): one qmm_parts call and no qmm of a part, for decode rows
    (each thread quantizing x for itself), a verification run and a prompt chunk (x quantized once, shared); every
    column the bits of the part's own matmul, with a bias, and in a bf16 input's round trip."""
    parts = [weight(fmt, rows, seed, products) for seed, (fmt, rows) in enumerate(zip(formats, (72, 40, 40)))]
    linear = QuantLinear(COLS, parts, bias=True, dtype=torch.float32)
    linear.bias = torch.nn.Parameter(torch.randn(linear.out_features))
    for m in (1, 3, 9, 40):
        x = torch.randn(m, COLS, generator=torch.Generator().manual_seed(m))
        want = each_alone(linear, x)
        with monkeypatch.context() as spy:
            whole, alone = count_c_calls(spy, "qmm_parts"), count_c_calls(spy, "qmm")
            y = linear(x)
        assert (whole, alone) == ([m], []), m
        assert torch.equal(y, want), m
        assert torch.equal(linear(x[None]), want[None])  # [batch, rows, cols] in, the same out
    if None not in formats:  # (a float part would be bf16 in a bf16 engine)
        x = torch.randn(5, COLS).bfloat16()
        assert torch.equal(linear(x), each_alone(linear, x))


def test_the_linear_attention_layers_input_projections_are_one_call(tmp_path, monkeypatch):
    """A qwen35moe file's Gated DeltaNet layer: q|k|v, z, b and a (Q4_K, Q5_K and Q8_0 parts: three ways of reading x)
    in one call for both in_proj_qkvz and in_proj_ba, each the bits of its own parts' matmuls; the model decodes the
    same tokens and logprobs as with the projections part by part."""
    path, _ = write_gguf("qwen35moe", tmp_path, quantized=True)
    llm = LLM(str(path), block_size=8, activations="int8", enable_prefix_caching=False)
    attention = llm.engine.model.model.layers[0].self_attn
    qkvz, ba = attention.in_proj_qkvz, attention.in_proj_ba
    x = torch.randn(7, qkvz.in_features, generator=torch.Generator().manual_seed(0))
    with monkeypatch.context() as spy:
        whole, alone = count_c_calls(spy, "qmm_parts"), count_c_calls(spy, "qmm")
        fused = attention._projections(x)
    assert (whole, alone) == ([7], [])
    assert torch.equal(fused[0], each_alone(qkvz, x)) and torch.equal(fused[1], each_alone(ba, x))
    prompts, greedy = (
        [[5, 9, 14, 21, 3, 8, 40, 7, 7, 30, 2], [11]],
        SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=0),
    )
    fused = [
        (o.outputs[0].token_ids, o.outputs[0].logprobs) for o in llm.generate(prompts, greedy, use_tqdm=False)
    ]
    monkeypatch.setattr(gated_deltanet, "outputs_of", lambda linears, x: [each_alone(w, x) for w in linears])
    alone = [
        (o.outputs[0].token_ids, o.outputs[0].logprobs) for o in llm.generate(prompts, greedy, use_tqdm=False)
    ]
    assert alone == fused
