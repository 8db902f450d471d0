"""What an engine holds on its device and when: the model's config and weights (the draft's too) at start and
after a deep sleep, the CUDA graphs, and the memory given back between requests while it sleeps. Each function
takes what it reads and returns what it makes; LLMEngine keeps the results."""

import gc
from dataclasses import dataclass

import torch

from backend.config import EngineConfig
from backend.context_length import fit_context
from backend.engine.kv_budget import CacheShape, pick_gpu_experts
from backend.engine.model_runner import ModelRunner
from backend.loader import ModelSource, load_model, read_config
from backend.model_config import ModelConfig
from backend.quant.weight_sizes import loaded_recipe, weight_bytes
from backend.speculative.draft import load_draft
from backend.speculative.speculative_config import SpeculativeConfig
from backend.speculative.vocab_bridge import VocabBridge


def read_model_config(source: ModelSource, config: EngineConfig) -> tuple[ModelConfig, object]:
    """The model's config under the RoPE scaling its max_model_len needs (backend.context_length), and the reader
    of its weights' files."""
    model_config, reader = read_config(source)
    model_config, _ = fit_context(model_config, config.rope_scaling, config.max_model_len)
    return model_config, reader


@dataclass(frozen=True)
class LoadedModels:
    model: torch.nn.Module
    draft: torch.nn.Module | None  # speculation's draft model (method "draft")
    vocab_bridge: VocabBridge | None  # a draft with another vocabulary: how its tokens meet the target's
    moe_gpu_experts: int | None  # the experts each MoE layer keeps on the device ("auto" chosen: None is all)


def load_models(config: EngineConfig, source: ModelSource, model_config: ModelConfig, reader,
                spec: SpeculativeConfig | None, device: torch.device, dtype: torch.dtype, products: str,
                shape: CacheShape, tokenizer, moe_gpu_experts: int | str | None) -> LoadedModels:
    """The draft's weights and the target's (loaded before the KV cache is sized, so both are counted; the
    draft first, so that moe_gpu_experts="auto" counts what it holds). A wake-up passes the count chosen at start,
    so the experts go where they were."""
    draft = bridge = None
    if spec is not None and spec.method == "draft":
        draft, bridge = load_draft(spec.model, model_config, device, dtype, shape.max_model_len, products,
                                   tokenizer, spec.vocab)
    if moe_gpu_experts == "auto":
        recipe = loaded_recipe(reader, config.quantization, source, dtype)
        moe_gpu_experts = pick_gpu_experts(config, shape, model_config, weight_bytes(model_config, recipe), draft)
    model = load_model(source, model_config, reader, dtype, device, shape.max_model_len, moe_gpu_experts,
                       config.quantization, products, config.moe_cpu_compute)
    return LoadedModels(model, draft, bridge, moe_gpu_experts)


def capture_graphs(runners: list[ModelRunner], shape: CacheShape) -> None:
    """Decode steps of up to shape.graph_rows rows recorded for each runner (the target's and a draft model's,
    their caches allocated): speculation's steps replay them too (model_runner.py)."""
    for runner in runners:
        runner.capture_graphs(shape.graph_rows, shape.max_model_len)


def check_sleep(level: int, busy: bool) -> None:
    if level not in (1, 2):
        raise ValueError(f"sleep level must be 1 or 2, got {level!r}")
    if busy:
        raise RuntimeError("cannot sleep while requests are running; finish or abort them first")


def give_memory_back(device: torch.device) -> None:
    """What the freed caches and weights held, returned to the system (and on CUDA to other programs)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
