"""The KV cache's groups (DESIGN.md, "Layer kinds and cache groups"): the full group (full and MLA layers: every
block of every position, engine/block_manager.py) and the sliding group (sliding-window layers: only the blocks a
window still reads, engine/window_blocks.py). Linear layers keep a state a sequence instead (engine/state_pool.py).

The sliding group has a pool of its own, sized from the settings: a running sequence never holds more of it than
the blocks one step's queries read (its tokens and the window - 1 positions before the first), so max_num_seqs
such spans serve every sequence the scheduler can run; the rest of the budget goes to the full group. A second
table a sequence (Sequence.window_table) and a second set of slots and tables in the attention metadata
(AttentionMetadata.sliding) lead each sliding layer to its pool: the kernels are the same.
"""

import math
import mmap
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch

from backend.kernels.attention import AttentionMetadata

if TYPE_CHECKING:
    from backend.config import EngineConfig
    from backend.engine.kv_budget import CacheShape


@dataclass(frozen=True)
class SlidingGroup:
    window: int  # the widest window of the group's layers: what each sequence keeps
    num_blocks: int


def group_window(cfg) -> int | None:
    """The widest sliding window of the model's layers; None without sliding layers."""
    return max((s.attention.window for s in cfg.layers if s.attention.kind == "sliding"), default=None)


def blocks_for(num_tokens: int, block_size: int) -> int:
    """The blocks that num_tokens positions fill (the last one perhaps in part)."""
    return (num_tokens + block_size - 1) // block_size


def blocks_a_sequence(window: int, step_tokens: int, block_size: int) -> int:
    """The most blocks of the sliding group one running sequence holds: a step's queries read window - 1
    positions before their first and their own step_tokens, which span at most one block more than they fill."""
    return (window - 1 + step_tokens + block_size - 1) // block_size + 1


def reserved_blocks(cfg, block_size: int, max_num_seqs: int, step_tokens: int, max_model_len: int) -> int:
    """The sliding group's pool for max_num_seqs running sequences; 0 where the model has no group (no sliding
    layer, or windows that, with a step's tokens, reach as far as max_model_len does: nothing to free)."""
    window = group_window(cfg)
    if window is None:
        return 0
    per_seq = blocks_a_sequence(window, step_tokens, block_size)
    return 0 if per_seq >= blocks_for(max_model_len, block_size) else max_num_seqs * per_seq


def block_bytes(cfg, block_size: int, dtype: torch.dtype, grouped: bool) -> tuple[int, int]:
    """(full group, sliding group): bytes of one block of every layer's paged cache in each; with grouped False
    every layer counts in the full group (a model without a sliding group)."""
    itemsize = torch.empty(0, dtype=dtype).element_size()
    sizes = [0, 0]
    for spec in cfg.layers:
        shapes = spec.attention.block_shapes(block_size, cfg.num_kv_heads, cfg.head_dim)
        sizes[grouped and spec.attention.kind == "sliding"] += itemsize * sum(math.prod(s) for s in shapes)
    return sizes[0], sizes[1]


def split_budget(budget: int, full_bytes: int, sliding_bytes: int, reserved: int) -> int:
    """The full group's blocks in `budget` bytes once the sliding group takes its `reserved` blocks, or, where
    that leaves the full group fewer than `reserved`, as many blocks as the full group gets (sliding_group never
    gives the sliding group more than the full group has: no sequence holds more sliding blocks than full)."""
    if not reserved:
        return budget // full_bytes
    if not full_bytes:  # every layer slides: the full group's table only counts positions
        return budget // sliding_bytes
    blocks = (budget - reserved * sliding_bytes) // full_bytes
    return blocks if blocks >= reserved else budget // (full_bytes + sliding_bytes)


def sliding_group(
    cfg, block_size: int, max_num_seqs: int, step_tokens: int, max_model_len: int, full_blocks: int
) -> SlidingGroup | None:
    reserved = reserved_blocks(cfg, block_size, max_num_seqs, step_tokens, max_model_len)
    return SlidingGroup(group_window(cfg), min(reserved, full_blocks)) if reserved else None


def group_sizes(config: "EngineConfig", shape: "CacheShape", configs: list) -> tuple[int, int, int]:
    """(bytes of a block in the full group, a draft's whole cache included; in the sliding group; the sliding
    group's reserved blocks, 0 without one), of the target's and a draft's model configs: a draft keeps one group."""
    cfg, size = configs[0], config.block_size
    reserved = reserved_blocks(
        cfg, size, config.max_num_seqs, shape.max_num_batched_tokens, shape.max_model_len
    )
    full, sliding = block_bytes(cfg, size, shape.kv_dtype, bool(reserved))
    return (
        full + sum(sum(block_bytes(c, size, shape.kv_dtype, False)) for c in configs[1:]),
        sliding,
        reserved,
    )


def sliding_of(config: "EngineConfig", shape: "CacheShape", cfg, full_blocks: int) -> SlidingGroup | None:
    """The sliding group of an engine whose full group has full_blocks blocks; None without one."""
    return sliding_group(
        cfg,
        config.block_size,
        config.max_num_seqs,
        shape.max_num_batched_tokens,
        shape.max_model_len,
        full_blocks,
    )


def token_bytes(models: list, sliding: SlidingGroup | None, dtype: torch.dtype) -> tuple[int, int]:
    """Bytes a token in the full group (a draft's included) and in the sliding group."""
    full, window = block_bytes(models[0].config, 1, dtype, sliding is not None)
    return full + sum(sum(block_bytes(m.config, 1, dtype, False)) for m in models[1:]), window


def window_metadata(
    meta: AttentionMetadata,
    tables: list[list[int]],
    slots: list[int],
    chunk_tables: list[list[int]],
    device: torch.device,
) -> AttentionMetadata:
    """The metadata a sliding layer reads: meta with the sliding group's slots and tables (decode rows' tables,
    each prompt chunk's); entries of -1 (released blocks, never read) become block 0."""

    def tensor(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=device)

    sliding = replace(meta, slot_mapping=tensor(slots))
    if tables:
        sliding.decode_block_tables = padded(tables, device)
    if chunk_tables:
        cpu = device.type == "cpu"
        sliding.prefills = [
            replace(c, block_table=tensor(t).clamp_(min=0) if cpu else None)
            for c, t in zip(meta.prefills, chunk_tables, strict=True)
        ]
        sliding.prefill_block_tables = padded(chunk_tables, device)
    return sliding


def padded(tables: list[list[int]], device: torch.device) -> torch.Tensor:
    """Window tables as one tensor, each padded with 0 to the longest, -1 entries as 0."""
    width = max(len(t) for t in tables)
    return torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.long, device=device).clamp_(
        min=0
    )


def window_slots(seq, start: int, count: int, block_size: int) -> list[int]:
    """The sliding group's cache slots of the sequence's positions start .. start + count - 1."""
    table = seq.window_table
    return [table[p // block_size] * block_size + p % block_size for p in range(start, start + count)]


def window_static(largest: int, width: int, device: torch.device) -> dict[str, torch.Tensor]:
    """A captured decode step's inputs for the sliding group (model_runner.allocate_static's)."""
    return {
        "window_slots": torch.full((largest,), -1, dtype=torch.long, device=device),
        "window_tables": torch.zeros(largest, width, dtype=torch.long, device=device),
    }


def window_static_meta(
    meta: AttentionMetadata, static: dict[str, torch.Tensor], rows: int
) -> AttentionMetadata:
    return replace(
        meta, slot_mapping=static["window_slots"][:rows], decode_block_tables=static["window_tables"][:rows]
    )


def fill_window_static(
    static: dict[str, torch.Tensor], slots: list[int], tables: list[list[int]], rows: int
) -> None:
    """The sliding group's slots and tables of a replayed step (model_runner.fill_static's)."""
    static["window_slots"][:rows].copy_(torch.tensor(slots + [-1] * (rows - len(slots))))
    limit = static["window_tables"].shape[1]
    tables = [t[:limit] for t in tables]
    width = max(len(t) for t in tables)
    static["window_tables"][: len(tables), :width].copy_(padded(tables, torch.device("cpu")))


def host_zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Zeros in anonymous memory: the kernel maps zero pages as they are first touched, so a cache of gigabytes
    costs nothing at start-up (torch.zeros writes every byte: 2.3 s for SmolLM2's default cache) and takes
    memory only as sequences fill it. The tensor keeps the mapping alive."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=dtype).view(shape)
