"""What an engine holds on its device and when: the model's config and weights (the draft's too) at start and
after a deep sleep, the KV cache and CUDA graphs, and sleep/wake, which lend the accelerator's memory to other
programs between requests."""

import gc
from typing import TYPE_CHECKING

import torch

from backend.context_length import fit_context
from backend.engine.block_manager import BlockManager
from backend.engine.kv_budget import pick_gpu_experts
from backend.loader import load_model, read_config
from backend.quant.weight_sizes import loaded_recipe, weight_bytes
from backend.spec.draft import DraftProposer, load_draft

if TYPE_CHECKING:
    from backend.engine.llm_engine import LLMEngine


def read_model_config(engine: "LLMEngine"):
    """The model's config under the RoPE scaling its max_model_len needs (backend.context_length)."""
    model_config, reader = read_config(engine.source)
    model_config, _ = fit_context(model_config, engine.config.rope_scaling, engine.config.max_model_len)
    return model_config, reader


def load_models(engine: "LLMEngine", reader=None):
    """The draft's weights and the target's (loaded before the KV cache is sized, so both are counted; the
    draft first, so that moe_gpu_experts="auto" counts what it holds)."""
    if reader is None:
        engine.model_config, reader = read_model_config(engine)
    draft = None
    if engine.spec is not None and engine.spec.method == "draft":
        draft, engine.vocab_bridge = load_draft(engine.spec.model, engine.model_config, engine.device, engine.dtype,
                                              engine.max_model_len, engine.products, engine.tokenizer, engine.spec.vocab)
    if engine.moe_gpu_experts == "auto":  # chosen once; a wake-up reloads the same placement
        recipe = loaded_recipe(reader, engine.config.quantization, engine.source.random_format, engine.dtype)
        engine.moe_gpu_experts = pick_gpu_experts(engine.config, engine.shape, engine.model_config,
                                                weight_bytes(engine.model_config, recipe), draft)
    model = load_model(engine.source, engine.model_config, reader, engine.dtype, engine.device, engine.max_model_len,
                       engine.moe_gpu_experts, engine.config.quantization, engine.products,
                       engine.config.moe_cpu_compute)
    return model, draft


def start_cache(engine: "LLMEngine") -> None:
    """A fresh KV cache and prefix cache (the draft's too), and the CUDA graphs that read them."""
    c = engine.config
    engine.block_manager = BlockManager(engine.num_kv_blocks, c.block_size, c.enable_prefix_caching,
                                        engine.disk_cache, engine.runner.state_slots)
    engine.scheduler.block_manager = engine.block_manager
    engine.runner.allocate_kv_cache(engine.num_kv_blocks)
    if isinstance(engine.proposer, DraftProposer):
        engine.proposer.wake_up(None, engine.num_kv_blocks)
    if engine.device.type == "cuda" and not c.enforce_eager:
        capture_graphs(engine)


def capture_graphs(engine: "LLMEngine") -> None:
    """Decode steps of up to shape.graph_rows rows recorded for the target's runner and a draft model's (their
    caches allocated): speculation's steps replay them too (model_runner.py)."""
    runners = [engine.runner] + ([engine.proposer.runner] if isinstance(engine.proposer, DraftProposer) else [])
    for runner in runners:
        runner.capture_graphs(engine.shape.graph_rows, engine.max_model_len)


def sleep(engine: "LLMEngine", level: int = 1) -> None:
    """Free the KV cache (and its prefix cache). Level 1 keeps the weights in CPU memory; level 2
    drops them, to be read from disk again on wake. Only between requests."""
    if level not in (1, 2):
        raise ValueError(f"sleep level must be 1 or 2, got {level!r}")
    if engine.has_unfinished_requests():
        raise RuntimeError("cannot sleep while requests are running; finish or abort them first")
    if engine.sleep_level:
        return
    engine.runner.free_kv_cache()
    if level == 2:
        engine.runner.model = engine.model = None
    elif engine.device.type != "cpu":
        engine.model.to("cpu")
    if isinstance(engine.proposer, DraftProposer):  # the draft's weights and cache go too
        engine.proposer.sleep(level)
    engine.sleep_level = level
    gc.collect()
    if engine.device.type == "cuda":
        torch.cuda.empty_cache()


def wake_up(engine: "LLMEngine") -> None:
    if not engine.sleep_level:
        return
    if engine.sleep_level == 2:
        engine.model, draft = load_models(engine)
        engine.runner.model = engine.model
        if draft is not None:
            engine.proposer.runner.model = engine.proposer.model = draft
    elif engine.device.type != "cpu":
        engine.model.to(engine.device)
    start_cache(engine)  # the draft's weights come back with its cache (DraftProposer.wake_up)
    engine.sleep_level = 0
