"""The GPU memory a server needs before it has loaded anything: its largest model's weights, the smallest KV
cache the engine accepts, and the activation estimate, the same functions the engine sizes itself with.
`serve --print-memory-need` prints it for ops' plan, and `--gpu-memory-utilization auto` takes it as budget."""

from dataclasses import dataclass, replace

import torch

from backend.arithmetic import pick_dtype
from backend.config import EngineConfig
from backend.context_length import serving_config
from backend.engine.cache_groups import group_sizes
from backend.engine.kv_budget import CacheShape, activation_bytes, kv_bytes_per_block, min_kv_bytes
from backend.engine.state_pool import state_pool_bytes
from backend.loader import locate, read_config
from backend.quant.weight_sizes import loaded_recipe, weight_bytes
from backend.speculative.speculative_config import SpeculativeConfig


@dataclass
class ModelNeed:
    name: str
    model: str
    weights: int  # what a load puts on the card (quantized blocks stay as they are): the file, or its resident part
    # the smallest cache the engine accepts (one sequence of max_model_len, or the size asked for; a sliding group's
    # pool beside it: engine/cache_groups.py), and a hybrid model's linear-attention states (a slot for each of
    # max_num_seqs)
    kv_cache: int
    activations: int
    max_model_len: int
    host_experts: int = 0  # offloaded experts (--moe-gpu-experts N), pinned in host memory instead

    @property
    def total(self) -> int:
        return self.weights + self.kv_cache + self.activations


def disk_bytes(model: str) -> int:
    """A model's weights on disk: what it needs before it has ever been loaded and measured."""
    source = locate(model)
    if source.gguf_file is not None:
        return source.gguf_file.stat().st_size
    return sum(p.stat().st_size for p in source.path.glob("*.safetensors"))


def placed_weights(config: EngineConfig, cfg, reader, dtype: torch.dtype) -> tuple[int, int]:
    """(on the card, in host memory): the file's bytes, or with --moe-gpu-experts N the weights a load keeps on the
    card (N experts per layer) and the offloaded experts it keeps in host memory (pinned to be copied, or with
    --moe-cpu-compute computed there), from the tensors' formats."""
    gpu_experts = config.moe_gpu_experts
    if not isinstance(gpu_experts, int) or not cfg.is_moe or gpu_experts >= cfg.num_experts:
        return disk_bytes(config.model), 0  # "auto" fits whatever budget it gets: the need is all of it
    source = locate(config.model)
    weights = weight_bytes(cfg, loaded_recipe(reader, config.quantization, source, dtype))
    return weights.resident(gpu_experts), weights.host(
        gpu_experts, cfg.num_experts, cfg.num_experts_per_tok, config.moe_cpu_compute
    )


def model_need(name: str, config: EngineConfig) -> ModelNeed:
    cfg, reader = read_config(locate(config.model))
    # The dtype a GPU gets, without asking one: pick_dtype's rules for a device that is neither CPU nor CUDA.
    dtype = pick_dtype(config.dtype, torch.device("meta"), cfg.torch_dtype)
    spec = SpeculativeConfig.parse(config.speculative)
    # a GPU's cache takes the model's dtype (kv_cache_dtype is the CPU's)
    shape = CacheShape.of(replace(config, kv_cache_dtype="auto"), cfg, spec, torch.device("meta"), dtype)
    per_block, sliding_block, reserved = group_sizes(config, shape, [cfg])
    weights, host = placed_weights(config, cfg, reader, dtype)
    if spec is not None and spec.model:
        # The draft keeps a cache of the target's length beside its own weights.
        draft_cfg, _ = read_config(locate(spec.model))
        weights += disk_bytes(spec.model)
        per_block += kv_bytes_per_block(draft_cfg, config.block_size, shape.kv_dtype)
    kv_cache = min_kv_bytes(
        config, per_block, shape.max_model_len, sliding_block, reserved
    ) + state_pool_bytes(cfg, config.max_num_seqs)
    return ModelNeed(
        name,
        config.model,
        weights,
        kv_cache,
        activation_bytes(cfg, shape.max_num_batched_tokens, shape.logit_rows, dtype, shape.max_model_len),
        shape.max_model_len,
        host,
    )


def server_need(config: EngineConfig, models: list[tuple[str, str]], models_memory: int | None) -> dict:
    """What a server of `models` (name, model) needs on the card: enough for its largest model alone (the
    others are unloaded to make room), or the --models-memory they may hold together when that is more."""
    needs = [model_need(name, serving_config(config, model)) for name, model in models]
    largest = max(needs, key=lambda n: n.total)
    need = largest.total
    if models_memory is not None:
        need = max(need, models_memory + largest.activations)
    return {
        "need_bytes": need,
        "largest": largest.name,
        "models_memory": models_memory,
        "models": [
            {
                "name": n.name,
                "model": n.model,
                "weights_bytes": n.weights,
                "kv_cache_bytes": n.kv_cache,
                "activation_bytes": n.activations,
                "max_model_len": n.max_model_len,
                "need_bytes": n.total,
                "host_experts_bytes": n.host_experts,
            }
            for n in needs
        ],
    }
