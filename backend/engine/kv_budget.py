"""How many KV-cache blocks an engine gets: from a setting, from free memory, or on CUDA from what its
gpu_memory_utilization budget leaves once the weights and a measured warm-up are counted; and, for
moe_gpu_experts="auto", how many experts per layer fit that budget before anything is loaded."""

import logging
import math
import os
from dataclasses import dataclass

import torch

from backend.arithmetic import pick_kv_dtype
from backend.config import EngineConfig
from backend.context_length import fit_context
from backend.engine.cache_groups import SlidingGroup, group_sizes, split_budget
from backend.engine.model_runner import ModelRunner
from backend.engine.scheduler import ScheduledSeq
from backend.engine.sequence import Sequence
from backend.engine.state_pool import is_hybrid, state_pool_bytes
from backend.kernels import step_paths
from backend.model_config import ModelConfig
from backend.quant.attention_sizes import attention_activation_bytes
from backend.sampling_params import SamplingParams
from backend.speculative.speculative_config import SpeculativeConfig

log = logging.getLogger(__name__)

# A small model on a large card could have tens of millions of blocks, each a Python object in the block
# manager; past 2**20 (16M tokens at block 16) they would cost host memory and start-up time for a cache
# no batch fills.
MAX_CUDA_BLOCKS = 1 << 20
GIB = 2**30
# The attention kernels multiply at least the 16 rows of a tensor-core matrix product and read the cache in tiles
# that do not depend on the block size; these are the sizes compiled and checked for sm_80/89/90.
CUDA_BLOCK_SIZES = (16, 32, 64, 128, 256)


def kv_bytes_per_block(model_config, block_size: int, dtype: torch.dtype) -> int:
    """Bytes of one block of every layer's paged cache, each layer's as its attention kind keeps it."""
    itemsize = torch.empty(0, dtype=dtype).element_size()
    return itemsize * sum(math.prod(shape) for spec in model_config.layers for shape in
                          spec.attention.block_shapes(block_size, model_config.num_kv_heads, model_config.head_dim))


def available_memory(device: torch.device) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def check_cuda_block_size(block_size: int) -> None:
    if block_size not in CUDA_BLOCK_SIZES:
        raise ValueError(f"block_size must be one of {', '.join(map(str, CUDA_BLOCK_SIZES))} on CUDA, "
                         f"got {block_size}; use 16 (the default) or 32")


def allowed_bytes(setting: float | int, card_total: int) -> int:
    """gpu_memory_utilization in bytes: a fraction of the card, or bytes already."""
    return int(setting * card_total) if isinstance(setting, float) else setting


def kv_cache_blocks(allowed: int, weights: int, peak: int, warm_cache: int, free: int, per_block: int,
                    setting: float | int, fit=None) -> int:
    """The KV cache's size in blocks on CUDA. allowed: the bytes this engine may use (its
    gpu_memory_utilization, a per-instance budget as ops hands it out); weights: resident before the
    warm-up; peak: the warm-up's peak (weights, its throwaway cache, activations); free: the card's free
    memory after it (weights still resident)."""
    activations = max(peak - warm_cache - weights, 0)
    kv = allowed - weights - activations
    if kv < per_block:
        raise ValueError(
            f"no room for a KV cache: gpu_memory_utilization={setting} allows {allowed / GIB:.1f} GiB, but the "
            f"weights take {weights / GIB:.1f} GiB and the activations of a full batch {activations / GIB:.1f} GiB; "
            "raise gpu_memory_utilization or lower max_num_batched_tokens")
    if kv + activations > free:
        raise ValueError(
            f"gpu_memory_utilization={setting} allows {allowed / GIB:.1f} GiB, but only {(free + weights) / GIB:.1f} GiB "
            f"of the card are free for this engine (other programs hold the rest); lower gpu_memory_utilization to "
            f"at most {(free + weights) / GIB:.1f}GiB or stop them (ops status shows who holds the card)")
    return fit(kv) if fit is not None else kv // per_block  # fit: the groups' split of kv bytes (num_kv_blocks)


def warm_up(model, tokens: int, max_model_len: int, block_size: int, device: torch.device,
            dtype: torch.dtype, logit_rows: int = 1, kv_dtype: torch.dtype | None = None, graph_rows: int = 0) -> int:
    """Run the largest prefill batch the scheduler can form once, through a throwaway KV cache, then the
    logits of the most rows one step can sample (a full decode batch, drafts included: 256 rows of a
    152k vocabulary are 230 MB), and with graph_rows, capture the largest CUDA graph: its memory pool stays
    held beside the cache for good (an H200 run's engine held 0.09 GiB over its budget before it was counted).
    Returns the throwaway cache's size in blocks (part of the measured peak)."""
    lengths = []
    while sum(lengths) < tokens:
        lengths.append(min(max_model_len - 1, tokens - sum(lengths)))
    blocks = sum((n + block_size - 1) // block_size for n in lengths)
    slots = len(lengths) if is_hybrid(model.config) else 0  # a hybrid model's prompts each need a state slot
    runner = ModelRunner(model, blocks, block_size, device, dtype, kv_dtype, state_slots=slots)
    batch, next_block = [], 0
    for n in lengths:
        seq = Sequence(seq_id=-1, request_id="warm-up", index=0, token_ids=[0] * n, num_prompt_tokens=n,
                       params=SamplingParams(max_tokens=1))
        count = (n + block_size - 1) // block_size
        seq.block_table, seq.state_slot = list(range(next_block, next_block + count)), len(batch)
        next_block += count
        batch.append(ScheduledSeq(seq, n))
    runner.execute(batch)
    with torch.inference_mode():
        model.compute_logits(torch.zeros(logit_rows, model.config.hidden_size, dtype=dtype, device=device))
    if graph_rows:
        runner.capture_graphs(graph_rows, max_model_len, largest_only=True)
    runner.free_kv_cache()  # and the graph with it
    return blocks


@dataclass
class CacheShape:
    """What sizing needs to know of an engine beyond its settings."""

    device: torch.device
    dtype: torch.dtype
    kv_dtype: torch.dtype  # the KV cache's: dtype, or what kv_cache_dtype asks for
    max_model_len: int
    max_num_batched_tokens: int
    prefill_tokens_while_decoding: int  # a step's prompt tokens while any sequence decodes (config.py)
    logit_rows: int  # the most rows one step samples (a full decode batch with its drafts)
    # the most rows a captured CUDA graph takes: a full decode batch, or the verification of as many sequences as
    # speculation serves (each its drafts and one more), as decode rows
    graph_rows: int

    @classmethod
    def of(cls, config: EngineConfig, cfg: ModelConfig, spec: SpeculativeConfig | None, device: torch.device,
           dtype: torch.dtype) -> "CacheShape":
        """The settings' lengths, else the model's context (at most 8192; backend.context_length) and 2048 tokens a step."""
        _, max_model_len = fit_context(cfg, config.rope_scaling, config.max_model_len)
        tokens = config.max_num_batched_tokens or min(2048, max_model_len)
        drafts = 0 if spec is None else spec.max_drafts
        speculated = 0 if spec is None else min(config.max_num_seqs, spec.max_batch_size)
        kv_dtype = pick_kv_dtype(config.kv_cache_dtype, device, dtype)
        prefill = config.long_prefill_token_threshold or (256 if device.type == "cpu" else tokens)
        return cls(device, dtype, kv_dtype, max_model_len, tokens, min(prefill, tokens),
                   min(config.max_num_seqs * (1 + drafts), tokens),
                   step_paths.graph_rows(config.max_num_seqs, speculated * (1 + drafts), tokens))


def num_kv_blocks(config: EngineConfig, shape: CacheShape, models: list) -> int:
    """Blocks for the KV cache of `models` (the target, then a draft that keeps a cache of the same size)."""
    block_size = config.block_size
    per_block, sliding_bytes, reserved = group_sizes(config, shape, [m.config for m in models])

    def fit(budget: int) -> int:  # the full group's blocks once the sliding group has its own (cache_groups.py)
        return split_budget(budget, per_block, sliding_bytes, reserved)

    needed_per_seq = (shape.max_model_len + block_size - 1) // block_size
    states = sum(state_pool_bytes(m.config, config.max_num_seqs) for m in models)  # hybrid models' (state_pool.py)
    if config.num_kv_blocks is not None:
        blocks = config.num_kv_blocks
    elif config.kv_cache_memory is None and shape.device.type == "cuda":
        blocks = min(_profile_cuda(config, shape, models, per_block + sliding_bytes, states, fit), MAX_CUDA_BLOCKS)
    elif config.kv_cache_memory is not None:
        m = config.kv_cache_memory
        budget = m if isinstance(m, int) else int(m * available_memory(shape.device))
        blocks = fit(budget - states)
    else:
        # Enough for every sequence slot at full length, but no more than a fifth of free memory
        # (and 2 GiB on the CPU, where the zeroed cache is paid for at start-up).
        cap_bytes = available_memory(shape.device) // 5
        if shape.device.type == "cpu":
            cap_bytes = min(cap_bytes, 2 << 30)
        blocks = max(min(config.max_num_seqs * needed_per_seq, fit(cap_bytes - states)), needed_per_seq)
    if blocks < needed_per_seq:
        raise ValueError(
            f"the KV cache holds {blocks} blocks of {block_size} tokens, but one sequence of max_model_len="
            f"{shape.max_model_len} needs {needed_per_seq}; give it more memory or lower max_model_len")
    return blocks


def _profile_cuda(config: EngineConfig, shape: CacheShape, models: list, per_block: int, states: int, fit) -> int:
    """Blocks that fit in gpu_memory_utilization once the weights (the draft's too) and the peak
    activations of the largest batch are counted: a warm-up runs that batch and measures it."""
    device = shape.device
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    # Reserved, not allocated, bytes: what the card gives the caching allocator, its segments' rounding and the
    # activations' fragmentation included, is what gpu_memory_utilization bounds (the first device run's engine
    # held 0.03 GiB over its budget when sized from allocated bytes).
    weights = torch.cuda.memory_reserved(device)
    graph_rows = 0 if config.enforce_eager else shape.graph_rows
    warm_blocks = max(warm_up(m, shape.max_num_batched_tokens, shape.max_model_len, config.block_size, device,
                              shape.dtype, shape.logit_rows, shape.kv_dtype, graph_rows) for m in models)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_reserved(device)
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    # The target's throwaway cache: the larger of the two warm-ups, so activations are not undercounted.
    warm_cache = kv_bytes_per_block(models[0].config, config.block_size, shape.kv_dtype) * warm_blocks
    # Each layer's K and V tensors are rounded up to the allocator's 2 MiB segments.
    rounding = sum(2 * m.config.num_layers for m in models) * 2 * 2**20
    return kv_cache_blocks(allowed_bytes(config.gpu_memory_utilization, total) - rounding - states, weights, peak, warm_cache,
                           free, per_block, config.gpu_memory_utilization, fit)


def activation_bytes(cfg: ModelConfig, tokens: int, logit_rows: int, dtype: torch.dtype, context: int = 0) -> int:
    """An upper estimate of one step's activations before the model exists to be measured: a few copies of the hidden
    states, the attention's (attention_sizes: a prompt chunk reading `context` positions), the widest MLP (all routed
    experts' rows of a token), fp32 logits and probabilities. Twice that: the CUDA warm-up measures the real peak."""
    width = max(cfg.intermediate_size if any(layer.mlp.kind == "dense" for layer in cfg.layers) else 0,
                cfg.num_experts_per_tok * cfg.moe_intermediate_size + cfg.shared_expert_intermediate_size)
    itemsize = torch.empty(0, dtype=dtype).element_size()
    attention = attention_activation_bytes(cfg, tokens, max(context, tokens), itemsize)
    return 2 * (tokens * (8 * cfg.hidden_size + 3 * width) * itemsize + attention + 2 * logit_rows * cfg.vocab_size * 4)


def min_kv_bytes(config: EngineConfig, per_block: int, max_model_len: int, sliding_block: int = 0,
                 reserved: int = 0) -> int:
    """The smallest KV cache the engine accepts: the size asked for, else one sequence of max_model_len; with a
    sliding group (reserved blocks of sliding_block bytes), its pool beside the full group's blocks, never more
    blocks than those (cache_groups.sliding_group)."""
    if isinstance(config.kv_cache_memory, int) and config.num_kv_blocks is None:
        return config.kv_cache_memory  # the groups share it
    blocks = config.num_kv_blocks
    if blocks is None:
        blocks = (max_model_len + config.block_size - 1) // config.block_size
    return blocks * per_block + min(reserved, blocks) * sliding_block


def report_memory(config: EngineConfig, device: torch.device, num_blocks: int, weights: int = 0,
                  host_experts: int = 0, states: int = 0, per_token: int = 0, window_token: int = 0,
                  sliding: SlidingGroup | None = None) -> None:
    """What the engine holds once ready (weights in their stored sizes, quantized ones as their blocks; KV cache,
    each group's: per_token and window_token bytes a token in the full and the sliding group; CUDA graphs); the
    CUDA context comes on top. On the CPU, the weights and the cache only."""
    how = "computed there by the CPU" if config.moe_cpu_compute else \
        ("pinned, " if device.type == "cuda" else "") + "copied in when routed to"
    held_weights = (f"linear-attention states {states / GIB:.2f} GiB ({config.max_num_seqs} slots); " if states
                    else "") + f"weights {weights / GIB:.2f} GiB" + (
        f" (and {host_experts / GIB:.2f} GiB of experts in host memory, {how})" if host_experts else "")
    cache = f"KV cache: {num_blocks} blocks of {config.block_size} tokens ({per_token} bytes a token)" + (
        f", sliding-window layers {sliding.num_blocks} blocks of their own ({window_token} bytes a token, kept for "
        f"the last {sliding.window} positions of each sequence)" if sliding else "")
    if device.type != "cuda":
        log.info("%s; %s", cache, held_weights)
        return
    held = torch.cuda.memory_reserved(device)
    u = config.gpu_memory_utilization
    allowed = allowed_bytes(u, torch.cuda.get_device_properties(device).total_memory)
    line = (f"{cache}; {held_weights}; the engine holds "
            f"{held / GIB:.2f} GiB of the card, gpu_memory_utilization={u} allows {allowed / GIB:.2f} GiB")
    if held > allowed and config.num_kv_blocks is None and config.kv_cache_memory is None:
        log.warning("%s: over by %.2f GiB (CUDA graphs, or the allocator's rounding)", line, (held - allowed) / GIB)
    else:
        log.info(line)
