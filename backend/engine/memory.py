"""How many KV-cache blocks an engine gets: from a setting, from free memory, or on CUDA from what its
gpu_memory_utilization budget leaves once the weights and a measured warm-up are counted."""

import logging
import os
from dataclasses import dataclass

import torch

from backend.config import EngineConfig
from backend.engine.model_runner import ModelRunner
from backend.engine.scheduler import ScheduledSeq
from backend.engine.sequence import Sequence
from backend.sampling_params import SamplingParams

log = logging.getLogger(__name__)

# A small model on a large card could have tens of millions of blocks, each a Python object in the block
# manager; past 2**20 (16M tokens at block 16) they would cost host memory and start-up time for a cache
# no batch fills.
MAX_CUDA_BLOCKS = 1 << 20
GIB = 2**30


def kv_bytes_per_block(model_config, block_size: int, dtype: torch.dtype) -> int:
    itemsize = torch.empty(0, dtype=dtype).element_size()
    return 2 * model_config.num_layers * block_size * model_config.num_kv_heads * model_config.head_dim * itemsize


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
    """The attention kernels load one cache block as a tile: a power of two, and at least the 16 rows
    of a tensor-core matrix product."""
    if block_size < 16 or block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two of at least 16 on CUDA, got {block_size}; use 16 or 32")


def allowed_bytes(setting: float | int, card_total: int) -> int:
    """gpu_memory_utilization in bytes: a fraction of the card, or bytes already."""
    return int(setting * card_total) if isinstance(setting, float) else setting


def kv_cache_blocks(allowed: int, weights: int, peak: int, warm_cache: int, free: int, per_block: int,
                    setting: float | int) -> int:
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
    return kv // per_block


def warm_up(model, tokens: int, max_model_len: int, block_size: int, device: torch.device,
            dtype: torch.dtype, logit_rows: int = 1) -> int:
    """Run the largest prefill batch the scheduler can form once, through a throwaway KV cache, then the
    logits of the most rows one step can sample (a full decode batch, drafts included: 256 rows of a
    152k vocabulary are 230 MB). Returns the throwaway cache's size in blocks (part of the measured peak)."""
    lengths = []
    while sum(lengths) < tokens:
        lengths.append(min(max_model_len - 1, tokens - sum(lengths)))
    blocks = sum((n + block_size - 1) // block_size for n in lengths)
    runner = ModelRunner(model, blocks, block_size, device, dtype)
    batch, next_block = [], 0
    for n in lengths:
        seq = Sequence(seq_id=-1, request_id="warm-up", index=0, token_ids=[0] * n, num_prompt_tokens=n,
                       params=SamplingParams(max_tokens=1))
        count = (n + block_size - 1) // block_size
        seq.block_table = list(range(next_block, next_block + count))
        next_block += count
        batch.append(ScheduledSeq(seq, n))
    runner.execute(batch)
    with torch.inference_mode():
        model.compute_logits(torch.zeros(logit_rows, model.config.hidden_size, dtype=dtype, device=device))
    runner.free_kv_cache()
    return blocks


@dataclass
class CacheShape:
    """What sizing needs to know of an engine beyond its settings."""

    device: torch.device
    dtype: torch.dtype
    max_model_len: int
    max_num_batched_tokens: int
    logit_rows: int  # the most rows one step samples (a full decode batch with its drafts)


def num_kv_blocks(config: EngineConfig, shape: CacheShape, models: list) -> int:
    """Blocks for the KV cache of `models` (the target, then a draft that keeps a cache of the same size)."""
    block_size = config.block_size
    per_block = sum(kv_bytes_per_block(m.config, block_size, shape.dtype) for m in models)
    needed_per_seq = (shape.max_model_len + block_size - 1) // block_size
    if config.num_kv_blocks is not None:
        blocks = config.num_kv_blocks
    elif config.kv_cache_memory is None and shape.device.type == "cuda":
        blocks = min(_profile_cuda(config, shape, models, per_block), MAX_CUDA_BLOCKS)
    elif config.kv_cache_memory is not None:
        m = config.kv_cache_memory
        budget = m if isinstance(m, int) else int(m * available_memory(shape.device))
        blocks = budget // per_block
    else:
        # Enough for every sequence slot at full length, but no more than a fifth of free memory
        # (and 2 GiB on the CPU, where the zeroed cache is paid for at start-up).
        cap_bytes = available_memory(shape.device) // 5
        if shape.device.type == "cpu":
            cap_bytes = min(cap_bytes, 2 << 30)
        blocks = max(min(config.max_num_seqs * needed_per_seq, cap_bytes // per_block), needed_per_seq)
    if blocks < needed_per_seq:
        raise ValueError(
            f"the KV cache holds {blocks} blocks of {block_size} tokens, but one sequence of max_model_len="
            f"{shape.max_model_len} needs {needed_per_seq}; give it more memory or lower max_model_len")
    return blocks


def _profile_cuda(config: EngineConfig, shape: CacheShape, models: list, per_block: int) -> int:
    """Blocks that fit in gpu_memory_utilization once the weights (the draft's too) and the peak
    activations of the largest batch are counted: a warm-up runs that batch and measures it."""
    device = shape.device
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    weights = torch.cuda.memory_allocated(device)
    warm_blocks = max(warm_up(m, shape.max_num_batched_tokens, shape.max_model_len, config.block_size, device,
                              shape.dtype, shape.logit_rows) for m in models)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    # The target's throwaway cache: the larger of the two warm-ups, so activations are not undercounted.
    warm_cache = kv_bytes_per_block(models[0].config, config.block_size, shape.dtype) * warm_blocks
    return kv_cache_blocks(allowed_bytes(config.gpu_memory_utilization, total), weights, peak, warm_cache, free,
                           per_block, config.gpu_memory_utilization)


def report_memory(config: EngineConfig, device: torch.device, num_blocks: int) -> None:
    """What the engine holds once ready (weights, KV cache, CUDA graphs); the CUDA context comes on top."""
    held = torch.cuda.memory_reserved(device)
    u = config.gpu_memory_utilization
    allowed = allowed_bytes(u, torch.cuda.get_device_properties(device).total_memory)
    line = (f"KV cache: {num_blocks} blocks of {config.block_size} tokens; the engine holds "
            f"{held / GIB:.2f} GiB of the card, gpu_memory_utilization={u} allows {allowed / GIB:.2f} GiB")
    if held > allowed and config.num_kv_blocks is None and config.kv_cache_memory is None:
        log.warning("%s: over by %.2f GiB (CUDA graphs)", line, (held - allowed) / GIB)
    else:
        log.info(line)
