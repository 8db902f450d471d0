"""`serve --print-memory-need`: the GPU memory a server needs before it loads anything, its largest model's
weights (the file's bytes), the KV cache of one max_model_len sequence and the activation estimate, checked
against the models' shapes; ops' `gpu_memory: auto` budgets the backend with it (tests/ops/test_plan.py)."""

import json
from types import SimpleNamespace

import pytest
import torch

from backend.__main__ import main
from backend.engine.kv_budget import activation_bytes
from backend.loader import locate, read_config


@pytest.fixture
def need(capsys):
    """python -m backend serve ARGS --print-memory-need, in this process: (exit code, stdout, stderr)."""

    def run(*args: str) -> SimpleNamespace:
        code = main(["serve", *args, "--print-memory-need"])
        out = capsys.readouterr()
        return SimpleNamespace(returncode=code, stdout=out.out, stderr=out.err)

    return run


def kv_bytes(cfg, tokens: int, itemsize: int) -> int:
    """K and V of every layer for `tokens` tokens, from the model's shape."""
    return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * itemsize * tokens


def test_the_largest_models_weights_kv_cache_and_activations(need, smollm2_path, tiny_dir):
    tiny = tiny_dir("qwen2")
    done = need("--model", "smollm2", "--model", f"tiny={tiny}", "--max-model-len", "1000")
    assert done.returncode == 0, done.stderr
    answer = json.loads(done.stdout)
    models = {m["name"]: m for m in answer["models"]}
    assert set(models) == {"smollm2", "tiny"}
    smol_cfg, _ = read_config(locate("smollm2"))
    smol = models["smollm2"]
    assert smol["weights_bytes"] == locate("smollm2").gguf_file.stat().st_size
    # 1000 tokens take 63 blocks of 16; SmolLM2 runs in bf16 on a GPU
    assert smol["kv_cache_bytes"] == kv_bytes(smol_cfg, 63 * 16, 2) == 63 * 16 * 2 * 30 * 3 * 64 * 2
    assert smol["activation_bytes"] == activation_bytes(smol_cfg, 1000, 64, torch.bfloat16)
    assert smol["need_bytes"] == smol["weights_bytes"] + smol["kv_cache_bytes"] + smol["activation_bytes"]
    assert models["tiny"]["weights_bytes"] == sum(p.stat().st_size for p in tiny.glob("*.safetensors"))
    assert answer["largest"] == "smollm2" and answer["need_bytes"] == smol["need_bytes"]
    assert models["tiny"]["need_bytes"] < smol["need_bytes"]

    # What --models-memory lets the loaded models hold together, when more than the largest alone
    together = json.loads(need("--model", "smollm2", "--model", f"tiny={tiny}", "--max-model-len", "1000",
                               "--models-memory", "2GiB").stdout)
    assert together["need_bytes"] == 2 * 2**30 + smol["activation_bytes"]


def test_a_model_that_is_not_there_is_named(need):
    done = need("--model", "/nowhere/model.gguf")
    assert done.returncode == 2 and "/nowhere/model.gguf" in done.stderr and not done.stdout


def test_the_model_as_vllm_serve_takes_it(need, tiny_dir):
    """`serve MODEL` as `vllm serve MODEL`: the same as a first --model, before any other."""
    tiny = tiny_dir("qwen2")
    done = need("smollm2", "--model", f"tiny={tiny}", "--max-model-len", "1000")
    assert done.returncode == 0, done.stderr
    assert [m["name"] for m in json.loads(done.stdout)["models"]] == ["smollm2", "tiny"]
    assert need("/nowhere/model.gguf").returncode == 2


def test_offloaded_experts_are_counted_in_host_memory_not_on_the_card(need, tiny_gguf):
    """--moe-gpu-experts N: the card holds every tensor but the experts, and N of each layer's experts; those that
    do not stay there for good are pinned in host memory. Checked against the GGUF's own tensors: quantized ones stay as their blocks, float
    ones (norms, the router) are held in bf16 on a GPU."""
    from gguf import GGUFReader

    from backend.quant.formats import BY_NAME

    path, _ = tiny_gguf("mixtral")  # 4 experts per layer
    tensors = GGUFReader(path).tensors

    def held(t) -> int:
        return int(t.n_bytes) if t.tensor_type.name in BY_NAME else int(t.n_elements) * 2

    experts = sum(held(t) for t in tensors if "_exps" in t.name)
    others = sum(held(t) for t in tensors if "_exps" not in t.name)
    everything = json.loads(need("--model", str(path)).stdout)["models"][0]
    assert everything["weights_bytes"] == path.stat().st_size and everything["host_experts_bytes"] == 0
    # 3 slots: expert 0 stays on the card for good, two slots rotate (top-2) among experts 1-3, kept in host memory
    three = json.loads(need("--model", str(path), "--moe-gpu-experts", "3").stdout)["models"][0]
    assert three["host_experts_bytes"] == 3 * experts // 4
    # The card's part from the model's shapes (norms counted in fp32, as the engine's own sizing counts them).
    assert three["weights_bytes"] == pytest.approx(others + 3 * experts // 4, rel=0.01)
    assert three["need_bytes"] == three["weights_bytes"] + three["kv_cache_bytes"] + three["activation_bytes"]
    # 2 slots: both rotate, every expert is in host memory
    two = json.loads(need("--model", str(path), "--moe-gpu-experts", "2").stdout)["models"][0]
    assert two["host_experts_bytes"] == experts and two["weights_bytes"] < three["weights_bytes"]
    # --moe-cpu-compute: no slot rotates; the 3 experts on the card stay, only the fourth is in host memory
    computed = json.loads(need("--model", str(path), "--moe-gpu-experts", "3", "--moe-cpu-compute").stdout)["models"][0]
    assert computed["host_experts_bytes"] == experts // 4 and computed["weights_bytes"] == three["weights_bytes"]
