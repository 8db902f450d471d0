"""The per-sequence recurrent state of linear-attention layers (DESIGN.md, "Layer kinds and cache groups"): the
cache group beside the paged KV cache for hybrid models (Qwen3-Next, Qwen3.5).

Each running sequence holds one slot: in every Gated DeltaNet layer, its convolution's last inputs and its delta
rule's matrix state, fp32 (models/gated_deltanet.py). The block manager takes a slot when it admits a sequence
and gives it back when the sequence finishes or is preempted (sequence.state_slot beside its block table); the
model runner allocates the tensors, max_num_seqs slots, and tells the layers each row's slot
(AttentionMetadata.states). A slot's old contents are never read: a sequence's first row starts from zeros.

Prefix caching: a state summarises every token before it, so a cached prefix is resumed only from a snapshot of
the states taken at exactly its end. SNAPSHOT_SLOTS more rows of the same tensors hold such snapshots, taken on
the block grid and reused least recently used first (engine/state_snapshots.py); the model runner copies them in
and out of the sequences' slots around a step's forward (resume_states, snapshot_states). A hit saves the
prefill of the prefix in every layer (the full-attention layers read its blocks, the linear layers start from
the snapshot) for one state copy in and one out a prompt.
"""

from typing import TYPE_CHECKING

import torch

from backend.model_config import ModelConfig
from backend.models.gated_deltanet import GatedDeltaNet

if TYPE_CHECKING:
    from backend.engine.scheduler import StepPlan

STATE_DTYPE = torch.float32
# Snapshots kept for prefix hits: one per conversation an agent resends (65.9 MB each at Qwen3.5-35B-A3B's
# widths, 527 MB in all), counted in the KV budget and --print-memory-need whether or not prefix caching is on.
SNAPSHOT_SLOTS = 8


def is_hybrid(cfg: ModelConfig) -> bool:
    """Whether the model has linear-attention layers (a state a sequence)."""
    return any(spec.attention.kind == "linear" for spec in cfg.layers)


def state_bytes_per_sequence(cfg: ModelConfig) -> int:
    """One slot's bytes over every linear layer: the convolution's kernel - 1 inputs of q|k|v, and the delta
    rule's [key_dim, value_dim] matrix per value head."""
    total = 0
    for spec in cfg.layers:
        shape = spec.attention.linear
        if shape is None:
            continue
        conv_dim = 2 * shape.num_key_heads * shape.key_head_dim + shape.num_value_heads * shape.value_head_dim
        total += conv_dim * (shape.conv_kernel - 1)
        total += shape.num_value_heads * shape.key_head_dim * shape.value_head_dim
    return total * torch.empty(0, dtype=STATE_DTYPE).element_size()


def state_pool_bytes(cfg: ModelConfig, max_num_seqs: int) -> int:
    """The pool the engine allocates: one slot for each sequence that may run at once and SNAPSHOT_SLOTS
    snapshots (0 without linear layers)."""
    return state_bytes_per_sequence(cfg) * (max_num_seqs + SNAPSHOT_SLOTS) if is_hybrid(cfg) else 0


class StatePool:
    """Which slots are free. Only the block manager takes and gives them."""

    def __init__(self, num_slots: int):
        self.num_slots = num_slots
        self.free = list(range(num_slots - 1, -1, -1))  # popped from the end: slot 0 first

    @property
    def num_free(self) -> int:
        return len(self.free)

    def take(self) -> int:
        if not self.free:
            raise RuntimeError(f"all {self.num_slots} linear-attention state slots are held")
        return self.free.pop()

    def give_back(self, slot: int) -> None:
        self.free.append(slot)


def allocate_states(modules: list[torch.nn.Module], num_slots: int, device: torch.device) -> None:
    """Zeroed state tensors in every linear-attention module: num_slots sequences' slots, then the snapshots'."""
    rows = num_slots + SNAPSHOT_SLOTS
    for module in modules:
        if isinstance(module, GatedDeltaNet):
            conv, delta = module.state_shapes()
            module.conv_state = torch.zeros((rows, *conv), dtype=STATE_DTYPE, device=device)
            module.delta_state = torch.zeros((rows, *delta), dtype=STATE_DTYPE, device=device)


def free_states(modules: list[torch.nn.Module]) -> None:
    for module in modules:
        if isinstance(module, GatedDeltaNet):
            module.conv_state = module.delta_state = torch.empty(0)


def resume_states(modules: list[torch.nn.Module], plan: "StepPlan") -> None:
    """Before a step's forward: each sequence admitted on a prefix hit takes its snapshot's states."""
    resuming = [item for item in plan if item.states and item.states.resume_from is not None]
    _copy(modules, [item.states.resume_from for item in resuming], [item.seq.state_slot for item in resuming])


def snapshot_states(modules: list[torch.nn.Module], plan: "StepPlan") -> None:
    """After it: each prompt chunk that ended at its snapshot boundary leaves its states in the snapshot slot."""
    taking = [item for item in plan if item.states and item.states.snapshot is not None]
    _copy(modules, [item.seq.state_slot for item in taking], [item.states.snapshot for item in taking])


def _copy(modules: list[torch.nn.Module], sources: list[int], targets: list[int]) -> None:
    if not sources:
        return
    for module in modules:
        if isinstance(module, GatedDeltaNet):
            for states in (module.conv_state, module.delta_state):
                taken = states.index_select(0, torch.tensor(sources, device=states.device))
                states.index_copy_(0, torch.tensor(targets, device=states.device), taken)
