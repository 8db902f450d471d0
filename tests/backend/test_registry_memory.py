"""The multi-model server's count of what a loaded engine holds (registry.engine_bytes, which decides which models
fit the memory budget): its KV part is the cache the engine allocated, each cache group's blocks, so a model whose
sliding-window layers keep only their own small pool counts that pool, not every block for every layer."""

import pytest

from backend import LLM
from backend.engine.kv_budget import kv_bytes_per_block
from backend.server.registry import engine_bytes


def allocated_cache_bytes(llm: LLM) -> int:
    """The bytes of the key and value tensors every layer's attention holds."""
    return sum(
        t.numel() * t.element_size()
        for layer in llm.engine.model.model.layers
        for t in (layer.self_attn.k_cache, layer.self_attn.v_cache)
    )


def weight_bytes(llm: LLM) -> int:
    model = llm.engine.model
    return sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))


@pytest.mark.parametrize("steps", [16, 512])
def test_engine_bytes_count_the_cache_each_group_holds(steps, tiny_dir):
    """16-token steps give Gemma 3's sliding layers (window 12) a pool of their own, far smaller than the full
    group's; 512-token steps reach the whole context, one pool for every layer. Either way the count is the
    weights and the cache allocated."""
    llm = LLM(
        str(tiny_dir("gemma3")), block_size=8, max_model_len=512, max_num_seqs=4, max_num_batched_tokens=steps
    )
    engine = llm.engine
    kv = engine_bytes(engine) - weight_bytes(llm)
    assert kv == allocated_cache_bytes(llm)
    every_block = engine.num_kv_blocks * kv_bytes_per_block(engine.model_config, 8, engine.shape.kv_dtype)
    if steps == 16:
        assert engine.runner.sliding is not None and kv < every_block
    else:
        assert engine.runner.sliding is None and kv == every_block
