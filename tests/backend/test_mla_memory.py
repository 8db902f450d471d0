"""What a latent-attention model's KV cache is sized by: one row of kv_lora_rank + qk_rope_head_dim a token a
layer (not keys and values of every head), in `serve --print-memory-need` and in the engine's KV budget. (The
ready log's bytes a token: test_deepseek_family.py.)"""

import json

import pytest

from backend import LLM
from backend.__main__ import main


def latent_row(directory) -> tuple[int, int]:
    """(layers, values a token a layer) from the checkpoint's config.json, not from our reading of it."""
    cfg = json.loads((directory / "config.json").read_text())
    return cfg["num_hidden_layers"], cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"]


def test_print_memory_need_counts_the_latent_row(tiny_dir, capsys):
    """A bf16 GPU's cache of one 100-token sequence (7 blocks of 16): the latent rows; GLM-4.5-shaped grouped-query
    attention beside it counts keys and values of every kv head."""
    v3, glm = tiny_dir("deepseek_v3"), tiny_dir("glm4_moe")
    args = [
        "serve",
        "--model",
        f"v3={v3}",
        "--model",
        f"glm={glm}",
        "--max-model-len",
        "100",
        "--dtype",
        "bfloat16",
    ]
    assert main([*args, "--print-memory-need"]) == 0
    models = {m["name"]: m for m in json.loads(capsys.readouterr().out)["models"]}
    layers, row = latent_row(v3)
    assert models["v3"]["kv_cache_bytes"] == 7 * 16 * layers * row * 2
    glm_cfg = json.loads((glm / "config.json").read_text())
    per_token = 2 * glm_cfg["num_key_value_heads"] * glm_cfg["head_dim"] * glm_cfg["num_hidden_layers"]
    assert models["glm"]["kv_cache_bytes"] == 7 * 16 * per_token * 2


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "bfloat16"])
def test_the_kv_budget_holds_as_many_blocks_as_latent_rows_fit(kv_cache_dtype, tiny_dir):
    """kv_cache_memory in bytes: exactly the blocks of latent rows it pays for, fp32 or bf16 (the CPU's choice)."""
    directory = tiny_dir("deepseek_v3")
    layers, row = latent_row(directory)
    itemsize = 4 if kv_cache_dtype == "auto" else 2
    per_block = 8 * layers * row * itemsize
    llm = LLM(
        str(directory),
        block_size=8,
        max_model_len=64,
        kv_cache_dtype=kv_cache_dtype,
        kv_cache_memory=37 * per_block + per_block // 2,
    )
    assert llm.engine.block_manager.num_blocks == 37
