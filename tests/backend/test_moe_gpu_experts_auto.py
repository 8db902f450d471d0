"""moe_gpu_experts="auto": the largest expert count per layer that fits the engine's budget after activations
and a minimum KV cache, on a quantized MoE GGUF. On the CPU a budget given in bytes stands for a card of that
size (the CPU itself keeps every expert resident), so the choice and the offloaded run are tested here."""

import logging

import pytest
import torch

from backend import LLM, SamplingParams
from backend.config import EngineConfig
from backend.engine.kv_budget import activation_bytes, kv_bytes_per_block, min_kv_bytes
from backend.loader import locate, read_config
from backend.models.moe import SparseMoE
from backend.quant.weight_sizes import file_recipe, weight_bytes
from tests.backend.conftest import prompts_of_lengths

SETTINGS = dict(block_size=8, max_model_len=64, max_num_batched_tokens=64, max_num_seqs=4)
PARAMS = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
PROMPTS = prompts_of_lengths(3, 17, 33)


def arithmetic(path):
    """The file's weights and what the engine reserves beside them, from the same functions it uses."""
    cfg, reader = read_config(locate(str(path)))
    weights = weight_bytes(cfg, file_recipe(reader, torch.float32))
    per_block = kv_bytes_per_block(cfg, SETTINGS["block_size"], torch.float32)
    config = EngineConfig(model=str(path), **SETTINGS)
    logit_rows = min(SETTINGS["max_num_seqs"], SETTINGS["max_num_batched_tokens"])
    reserved = activation_bytes(
        cfg, SETTINGS["max_num_batched_tokens"], logit_rows, torch.float32
    ) + min_kv_bytes(config, per_block, SETTINGS["max_model_len"])
    return cfg, weights, reserved


def slots(llm: LLM) -> list[int]:
    return [
        m.expert_cache.slots
        for m in llm.engine.model.modules()
        if isinstance(m, SparseMoE) and m.expert_cache
    ]


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
def test_auto_picks_the_largest_count_that_fits_and_gives_identical_tokens(family, tiny_gguf, caplog):
    path, _ = tiny_gguf(family)
    cfg, weights, reserved = arithmetic(path)
    assert cfg.num_experts == 4
    expected = [
        o.outputs[0].token_ids for o in LLM(str(path), **SETTINGS).generate(PROMPTS, PARAMS, use_tqdm=False)
    ]

    budget = weights.resident(3) + reserved - 1  # one byte short of 3 experts per layer
    with caplog.at_level(logging.INFO, logger="backend.engine.residency"):
        auto = LLM(str(path), moe_gpu_experts="auto", gpu_memory_utilization=budget, **SETTINGS)
    assert auto.engine.moe_gpu_experts == 2 and set(slots(auto)) == {2}
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("moe_gpu_experts=auto")]
    assert len(lines) == 1 and "2 of 4 experts per layer on the device" in lines[0]
    assert [o.outputs[0].token_ids for o in auto.generate(PROMPTS, PARAMS, use_tqdm=False)] == expected
    caches = [
        m.expert_cache for m in auto.engine.model.modules() if isinstance(m, SparseMoE) and m.expert_cache
    ]
    assert all(c.misses > 0 for c in caches)  # experts really moved in and out

    assert (
        LLM(
            str(path), moe_gpu_experts="auto", gpu_memory_utilization=budget + 1, **SETTINGS
        ).engine.moe_gpu_experts
        == 3
    )
    whole = LLM(
        str(path), moe_gpu_experts="auto", gpu_memory_utilization=weights.total + reserved, **SETTINGS
    )
    assert whole.engine.moe_gpu_experts is None and slots(whole) == []


def test_auto_refuses_a_budget_below_one_expert_per_layer(tiny_gguf):
    path, _ = tiny_gguf("mixtral")
    _, weights, reserved = arithmetic(path)
    with pytest.raises(ValueError, match="with one expert per layer resident"):
        LLM(
            str(path),
            moe_gpu_experts="auto",
            gpu_memory_utilization=weights.resident(1) + reserved - 1,
            **SETTINGS,
        )


def test_auto_on_the_cpu_without_a_byte_budget_keeps_every_expert(tiny_gguf):
    path, _ = tiny_gguf("mixtral")
    llm = LLM(str(path), moe_gpu_experts="auto", **SETTINGS)
    assert llm.engine.moe_gpu_experts is None and slots(llm) == []


def test_the_setting_is_checked():
    with pytest.raises(ValueError, match="moe_gpu_experts must be an integer >= 1 or 'auto', got 'some'"):
        EngineConfig(model="x", moe_gpu_experts="some")
