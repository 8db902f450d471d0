"""The CUDA path: its host-side pieces run here; what needs a GPU runs where there is one and skips here."""

import pytest
import torch

from backend import LLM, SamplingParams
from backend.engine.llm_engine import warm_up
from backend.loader import load_model, locate, read_config
from tests.backend.conftest import prompts_of_lengths

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_the_warm_up_batch_runs_through_a_throwaway_cache(tiny_dir):
    source = locate(str(tiny_dir("llama")))
    config, reader = read_config(source)
    model = load_model(source, config, reader, torch.float32, torch.device("cpu"), 512)
    blocks = warm_up(model, tokens=700, max_model_len=512, block_size=16, device=torch.device("cpu"),
                     dtype=torch.float32)
    assert blocks == 32 + 12  # 511 + 189 tokens in blocks of 16


def test_random_weight_models_take_token_ids(tmp_path):
    import json

    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["Qwen3ForCausalLM"], "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "max_position_embeddings": 256, "scriptorium_random_weights": True}))
    llm = LLM(str(tmp_path), block_size=16)
    out = llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 5 and out[0].outputs[0].text == ""
    with pytest.raises(ValueError, match="has no tokenizer: give prompts as token ids"):
        llm.generate("text", use_tqdm=False)


@needs_gpu
@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_graphs_and_kernels_match_eager_on_the_gpu(family, dtype, tiny_dir):
    prompts = prompts_of_lengths(3, 17, 33, 50)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    eager = LLM(str(tiny_dir(family)), device="cuda", dtype=dtype, enforce_eager=True)
    graphs = LLM(str(tiny_dir(family)), device="cuda", dtype=dtype)
    a = [o.outputs[0].token_ids for o in eager.generate(prompts, params, use_tqdm=False)]
    b = [o.outputs[0].token_ids for o in graphs.generate(prompts, params, use_tqdm=False)]
    assert a == b
    if dtype == "float32":
        cpu = LLM(str(tiny_dir(family)), device="cpu")
        assert [o.outputs[0].token_ids for o in cpu.generate(prompts, params, use_tqdm=False)] == a


@needs_gpu
def test_kv_cache_is_sized_from_gpu_memory_utilization(tiny_dir):
    small = LLM(str(tiny_dir("llama")), device="cuda", gpu_memory_utilization=0.3, enforce_eager=True)
    large = LLM(str(tiny_dir("llama")), device="cuda", gpu_memory_utilization=0.6, enforce_eager=True)
    assert large.engine.num_kv_blocks > small.engine.num_kv_blocks > 0


def test_the_device_benchmark_runs_in_smoke_mode():
    """bench/device.py on tiny shapes on the CPU (its kernels through the interpreter): every figure prints."""
    import json
    import os
    import subprocess
    import sys

    from tests.backend.server_process import ROOT

    result = subprocess.run([sys.executable, "bench/device.py", "--smoke"], capture_output=True, text=True,
                            cwd=ROOT, timeout=600, env={**os.environ, "TRITON_INTERPRET": "1"})
    assert result.returncode == 0, result.stderr[-2000:]
    rows = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    figures = [r["figure"] for r in rows]
    assert figures.count("decode_batch1") == 3 and "throughput" in figures and figures.count("fused_moe") == 2
    assert [r["identical"] for r in rows if r["figure"] == "speculative_self_draft"] == [True, True]
