"""GGUF's codebook and ternary formats (IQ*, MXFP4, TQ*): decoded bit for bit as gguf-py's dequantize does, kept in
their blocks on the CPU (the 8-bit kernels take them as small integers a group) and on the CUDA path (the Triton
kernels read the blocks themselves), and a file mixing them with K-quants, as the quantizers ship, generating as
transformers does on the same weights."""

import numpy as np
import pytest
import torch

from backend import LLM, SamplingParams
from backend.kernels import moe_torch, native, quant_moe_triton
from backend.loader import load_model, locate, read_config
from backend.quant.formats import BY_NAME, dequantize, row_bytes
from backend.quant.modules import QuantEmbedding, QuantWeight
from backend.quant.weight_sizes import file_recipe, module_bytes, weight_bytes
from tests.backend.conftest import (
    KERNEL_DEVICE,
    hf_greedy,
    interpreted_only,
    on_kernel_device,
    prompts_of_lengths,
)
from tests.backend.cuda_emulation import emulate_cuda
from tests.backend.quant_blocks import gguf_dequant, random_raw
from tests.backend.test_models_vs_transformers import prefill_logits

CODEBOOKS = [
    "IQ4_NL",
    "IQ4_XS",
    "IQ3_XXS",
    "IQ3_S",
    "IQ2_XXS",
    "IQ2_XS",
    "IQ2_S",
    "IQ1_S",
    "IQ1_M",
    "MXFP4",
    "TQ1_0",
    "TQ2_0",
]
# a quantizer's mix: five formats (three codebooks, two K-quants) and two more codebooks
MIXED = {
    "token_embd": "IQ4_XS",
    "output": "Q6_K",
    "attn_q": "IQ4_XS",
    "attn_k": "IQ3_S",
    "attn_v": "Q6_K",
    "attn_output": "IQ2_XXS",
    "ffn_gate": "Q4_K",
    "ffn_up": "IQ4_NL",
    "ffn_down": "MXFP4",
}
# a MoE file whose expert stacks are codebooks
MOE_POLICY = {
    "token_embd": "Q8_0",
    "output": "Q6_K",
    "attn_q": "IQ4_NL",
    "attn_k": "IQ4_NL",
    "attn_v": "IQ3_S",
    "attn_output": "IQ4_XS",
    "ffn_gate_exps": "IQ3_XXS",
    "ffn_up_exps": "IQ4_XS",
    "ffn_down_exps": "IQ2_S",
}
PROMPTS = prompts_of_lengths(3, 17, 33)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # gguf-py's own inf and nan from random scale bytes
@pytest.mark.parametrize("name", CODEBOOKS)
def test_every_codebook_format_decodes_bit_for_bit_as_gguf_py(name):
    fmt = BY_NAME[name]
    cols = 2 * fmt.block
    raw = random_raw(name, 37, cols, seed=4, lead=(2,))  # scales of a trained model's size
    assert torch.equal(dequantize(torch.from_numpy(raw), fmt, cols), gguf_dequant(raw, name))
    # every byte random, scale fields included: grid indices, sign patterns and deltas of every value, inf and nan
    noise = np.random.default_rng(5).integers(
        0, 256, size=(64, cols // fmt.block * fmt.block_bytes), dtype=np.uint8
    )
    ours = dequantize(torch.from_numpy(noise), fmt, cols).numpy()
    assert np.array_equal(ours, gguf_dequant(noise, name).numpy(), equal_nan=True)


def _kept(model) -> dict[str, str]:
    """The format of each weight kept in blocks, by module name."""
    return {
        name: m.fmt.name
        for name, m in model.named_modules()
        if isinstance(m, QuantWeight) and m.fmt is not None
    }


@pytest.fixture
def mixed(tiny_gguf):
    return tiny_gguf("llama", "mixed", policy=MIXED)


@pytest.mark.parametrize("kernels", ["torch", "ours"])
def test_a_file_mixing_codebooks_and_k_quants_generates_as_transformers_does(
    kernels, mixed, hf_model, monkeypatch
):
    """The torch path (transformers' own arithmetic) matches its logits and greedy tokens; our C kernels (the same
    weights, bit for bit, summed in another order) its greedy tokens."""
    if kernels == "torch":
        monkeypatch.setattr(native, "enabled", lambda: False)
    elif not native.enabled():
        pytest.skip("no C compiler for the CPU kernels")
    path, ref_dir = mixed
    reference = hf_model(ref_dir)
    llm = LLM(str(path), block_size=8)
    model = llm.engine.model
    kept = set(_kept(model).values())
    assert {"IQ4_XS", "IQ3_S", "IQ2_XXS", "IQ4_NL", "MXFP4", "Q4_K", "Q6_K"} <= kept
    assert isinstance(model.model.embed_tokens, QuantEmbedding)
    if kernels == "ours":
        assert all(m.layout is not None for m in model.modules() if isinstance(m, QuantWeight) and m.fmt)
    else:
        for prompt, ours in zip(PROMPTS, prefill_logits(llm, PROMPTS)):
            with torch.no_grad():
                expected = reference(torch.tensor([prompt])).logits[0]
            torch.testing.assert_close(ours, expected, atol=1e-4, rtol=1e-4)
    outputs = llm.generate(
        PROMPTS, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False
    )
    for prompt, out in zip(PROMPTS, outputs):
        assert out.outputs[0].token_ids == hf_greedy(reference, prompt, 24)


def test_the_gpus_path_keeps_codebooks_in_their_blocks_and_weight_sizes_counts_it(mixed, monkeypatch):
    """Where the Triton kernels run (here their interpreter, as on CUDA) every tensor of the mix stays in its blocks,
    the file's own bytes: weight_bytes over the file's formats is what the model holds, and the kept weights are
    the CPU path's."""
    path, _ = mixed
    source = locate(str(path))
    cfg, reader = read_config(source)
    monkeypatch.setenv("SCRIPTORIUM_QUANT_CPU", "reference")  # unpacked, so bytes held are the blocks' own
    on_cpu = load_model(source, cfg, reader, torch.float32, torch.device("cpu"), 64)
    emulate_cuda(monkeypatch)
    on_gpu_path = load_model(source, cfg, reader, torch.float32, torch.device("cpu"), 64)
    assert set(_kept(on_gpu_path).values()) == {
        "IQ4_XS",
        "IQ3_S",
        "IQ2_XXS",
        "IQ4_NL",
        "MXFP4",
        "Q4_K",
        "Q6_K",
    }
    assert module_bytes(on_gpu_path) == weight_bytes(cfg, file_recipe(reader)).total == module_bytes(on_cpu)
    for name in ("self_attn.o_proj", "mlp.down_proj"):
        cpu_part = on_cpu.model.layers[0].get_submodule(name).parts[0]
        assert torch.equal(on_gpu_path.model.layers[0].get_submodule(name).parts[0].data, cpu_part.data)


@interpreted_only
@pytest.mark.parametrize("family", ["mixed", "moe"])
def test_codebook_models_on_the_cuda_path_decode_as_the_cpu_path_does(family, mixed, tiny_gguf, monkeypatch):
    """The interpreted Triton kernels (block-wise GEMV, GEMM and MoE over the codebooks' own blocks) against our
    CPU kernels on the same file: the same greedy tokens, dense (five formats mixed) and MoE (codebook experts)."""
    policy = MIXED if family == "mixed" else MOE_POLICY
    path = str(mixed[0] if family == "mixed" else tiny_gguf("qwen3_moe", "codebooks", policy=policy)[0])
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    settings = dict(block_size=16, max_num_seqs=4, max_model_len=256)
    prompts = PROMPTS[:2]  # the interpreter is slow: a prefill of each kind of kernel, and a few decode steps
    expected = [
        o.outputs[0].token_ids for o in LLM(path, **settings).generate(prompts, params, use_tqdm=False)
    ]
    emulate_cuda(monkeypatch)
    monkeypatch.setattr(native, "enabled", lambda: False)  # cached from the first engine: no CPU repack here
    llm = LLM(path, **settings)
    kept = [m for m in llm.engine.model.modules() if isinstance(m, QuantWeight) and m.fmt is not None]
    # every tensor in its blocks (none expanded to floats), the file's bytes (no CPU repack)
    assert {m.fmt.name for m in kept} == set(policy.values())
    assert [m for m in kept if m.layout is not None or m.data.dtype != torch.uint8] == []
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == expected


EXPERT_FORMATS = [
    ("IQ3_XXS", "IQ4_XS", "IQ2_S"),
    ("MXFP4", "MXFP4", "MXFP4"),
    ("IQ1_M", "Q3_K", "TQ2_0"),
    ("IQ2_XS", "IQ1_S", "IQ4_NL"),
    ("TQ1_0", "IQ3_S", "IQ2_XXS"),
]


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("formats", EXPERT_FORMATS)
@pytest.mark.parametrize("tokens", [1, 9])
def test_triton_moe_over_codebook_experts_matches_the_float64_reference(formats, tokens):
    """quant_moe_triton.fused_moe with every codebook format as gate, up or down (beside a K-quant the per-weight
    tiles read): one token takes the per-pair block GEMV, nine the grouped block-wise GEMM; both against the MoE in
    float64 over gguf-py's dequantized experts."""
    experts, hidden, inter, top_k = 4, 256, 256, 2
    stacks, dense = [], []
    for i, (name, rows, cols) in enumerate(zip(formats, (inter, inter, hidden), (hidden, hidden, inter))):
        raw = random_raw(name, rows, cols, seed=20 + i, lead=(experts,))
        stacks.append(
            (torch.from_numpy(raw).to(KERNEL_DEVICE), BY_NAME[name].ggml_type, row_bytes(BY_NAME[name], cols))
        )
        dense.append(torch.stack([gguf_dequant(raw[e], name) for e in range(experts)]).double())
    gen = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, hidden, generator=gen)
    weights, ids = moe_torch.route(torch.randn(tokens, experts, generator=gen), top_k, True)
    ref = moe_torch.fused_moe(x.double(), torch.cat(dense[:2], 1), dense[2], weights.double(), ids)
    out = on_kernel_device(quant_moe_triton.fused_moe, x, *stacks, weights, ids)
    torch.testing.assert_close(out.double(), ref, atol=1e-4 * ref.abs().max().item(), rtol=1e-4)


def test_codebook_expert_stacks_generate_as_transformers_does(tiny_gguf, hf_model):
    """A MoE file whose expert stacks are codebooks (an IQ3_XXS gate, IQ4_XS up, IQ2_S down): kept in their
    blocks, computed by our CPU kernels (or the torch path without them), transformers' greedy tokens."""
    path, ref_dir = tiny_gguf("qwen3_moe", "codebooks", policy=MOE_POLICY)
    llm = LLM(str(path), block_size=8)
    experts = llm.engine.model.model.layers[0].mlp.experts
    assert (experts.gate.fmt.name, experts.up.fmt.name, experts.down.fmt.name) == (
        "IQ3_XXS",
        "IQ4_XS",
        "IQ2_S",
    )
    outputs = llm.generate(
        PROMPTS, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False
    )
    for prompt, out in zip(PROMPTS, outputs):
        assert out.outputs[0].token_ids == hf_greedy(hf_model(ref_dir), prompt, 24)
