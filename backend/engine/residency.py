"""What an engine holds on its device and when: the model's config and weights (the draft's too) at start and
after a deep sleep, the CUDA graphs, the memory given back between requests while it sleeps, and how many of a MoE model's experts
stay on the device (moe_gpu_experts="auto", chosen before the model loads). Each function
takes what it reads and returns what it makes; LLMEngine keeps the results."""

import gc
import logging
from dataclasses import dataclass

import torch

from backend.config import EngineConfig
from backend.context_length import fit_context
from backend.engine.cache_groups import group_sizes
from backend.engine.kv_budget import GIB, CacheShape, activation_bytes, allowed_bytes, min_kv_bytes
from backend.engine.model_runner import ModelRunner
from backend.engine.state_pool import state_pool_bytes
from backend.loader import ModelSource, load_model, read_config
from backend.model_config import ModelConfig
from backend.quant.weight_sizes import WeightBytes, fit_gpu_experts, loaded_recipe, module_bytes, weight_bytes
from backend.speculative.draft import load_draft
from backend.speculative.speculative_config import SpeculativeConfig
from backend.speculative.vocab_bridge import VocabBridge

log = logging.getLogger(__name__)


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


def expert_budget(config: EngineConfig, device: torch.device) -> int | None:
    """The bytes experts may compete for: the gpu_memory_utilization budget (and no more than the card has
    free). On the CPU the device is host memory, where offloading saves nothing: None (all resident),
    unless the budget is given in bytes (a dry run of what a card of that size would get)."""
    u = config.gpu_memory_utilization
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return min(allowed_bytes(u, total), free)
    return u if isinstance(u, int) else None


def auto_gpu_experts(config: EngineConfig, cfg: ModelConfig, weights: WeightBytes, budget: int | None,
                     reserved: int) -> int | None:
    """moe_gpu_experts="auto": the largest count per layer that fits `budget` once `reserved` (activations, the
    minimum KV cache, a draft) is counted; None when every expert fits. Logs the choice."""
    if budget is None:
        log.info("moe_gpu_experts=auto: all %d experts per layer resident (no device budget to fit)", cfg.num_experts)
        return None
    n = fit_gpu_experts(weights, budget, reserved, cfg.num_experts)
    chosen = cfg.num_experts if n is None else n
    log.info("moe_gpu_experts=auto: %d of %d experts per layer on the device (%.2f GiB of weights there, %.2f GiB "
             "in host memory) within a budget of %.2f GiB after %.2f GiB for activations and a minimum KV cache",
             chosen, cfg.num_experts, weights.resident(n) / GIB,
             weights.host(n, cfg.num_experts, cfg.num_experts_per_tok, config.moe_cpu_compute) / GIB,
             budget / GIB, reserved / GIB)
    return n


def pick_gpu_experts(config: EngineConfig, shape: CacheShape, cfg: ModelConfig, weights: WeightBytes,
                     draft=None) -> int | None:
    """moe_gpu_experts="auto" for a model of these weights, before it is loaded (a draft already is)."""
    if not cfg.is_moe:
        return None
    per_block, sliding_block, window_blocks = group_sizes(config, shape, [cfg] + ([draft.config] if draft else []))
    reserved = activation_bytes(cfg, shape.max_num_batched_tokens, shape.logit_rows, shape.dtype, shape.max_model_len)
    if draft is not None:
        reserved += module_bytes(draft)
    reserved += min_kv_bytes(config, per_block, shape.max_model_len, sliding_block, window_blocks) + state_pool_bytes(
        cfg, config.max_num_seqs)
    return auto_gpu_experts(config, cfg, weights, expert_budget(config, shape.device), reserved)
