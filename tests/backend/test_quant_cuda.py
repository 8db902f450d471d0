"""Quantized weights on the GPU: the compiled kernels against the torch reference, and tiny GGUF models on CUDA
(eager, CUDA graphs, offloaded experts) against the CPU's exact path. Skipped without a GPU."""

import pytest
import torch

from backend import LLM, SamplingParams
from backend.kernels import quant_moe_triton, quant_triton
from backend.quant.formats import BY_NAME, dequantize, row_bytes
from tests.backend.conftest import prompts_of_lengths
from tests.backend.quant_blocks import random_raw

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@needs_gpu
@pytest.mark.parametrize("name", list(BY_NAME))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 3, 33, 200])
def test_compiled_linear_kernels_match_the_reference(name, dtype, m):
    fmt = BY_NAME[name]
    rows, cols = 300, 5 * fmt.block * (1 if fmt.block == 256 else 8)
    raw = torch.from_numpy(random_raw(name, rows, cols, seed=m)).cuda()
    x = torch.randn(m, cols, device="cuda").to(dtype)
    ref = x.float() @ dequantize(raw, fmt, cols, dtype).float().T
    y = quant_triton.qlinear(x, raw, fmt.ggml_type, rows, cols, row_bytes(fmt, cols)).float()
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(y, ref, atol=tol * ref.abs().max().item(), rtol=tol)


@needs_gpu
@pytest.mark.parametrize("tokens", [1, 300])
def test_compiled_moe_kernels_match_the_reference(tokens):
    from backend.kernels.moe_torch import route

    e, h, inter, top_k = 8, 512, 768, 2
    stacks = []
    for i, (name, r, c) in enumerate((("Q4_K", inter, h), ("Q4_K", inter, h), ("Q6_K", h, inter))):
        raw = torch.from_numpy(random_raw(name, r, c, seed=i, lead=(e,))).cuda()
        stacks.append((raw, BY_NAME[name], c))
    x = torch.randn(tokens, h, device="cuda")
    weights, ids = route(torch.randn(tokens, e, device="cuda"), top_k, True)
    dense = [dequantize(raw, fmt, c) for raw, fmt, c in stacks]
    from backend.kernels.moe_torch import fused_moe

    ref = fused_moe(x.cpu(), torch.cat(dense[:2], 1).cpu(), dense[2].cpu(), weights.cpu(), ids.cpu())
    out = quant_moe_triton.fused_moe(x, *[(raw, fmt.ggml_type, row_bytes(fmt, c)) for raw, fmt, c in stacks],
                                     weights, ids)
    torch.testing.assert_close(out.cpu(), ref, atol=1e-3 * ref.abs().max().item(), rtol=1e-3)


@needs_gpu
@pytest.mark.parametrize("family", ["llama", "mixtral"])
def test_tiny_gguf_models_on_cuda_match_the_cpu_exact_path(family, tiny_gguf, monkeypatch):
    path, _ = tiny_gguf(family)
    prompts = prompts_of_lengths(3, 17, 33)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)

    def tokens(**kw):
        llm = LLM(str(path), block_size=16, gpu_memory_utilization=0.2, **kw)
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]

    eager = tokens(device="cuda", dtype="float32", enforce_eager=True)
    assert tokens(device="cuda", dtype="float32") == eager  # CUDA graphs
    if family == "mixtral":
        assert tokens(device="cuda", dtype="float32", moe_gpu_experts=2) == eager
    assert len(tokens(device="cuda", dtype="bfloat16")[0]) == 24
    monkeypatch.setenv("SCRIPTORIUM_QUANT_CPU", "reference")
    assert tokens(device="cpu") == eager
