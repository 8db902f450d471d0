"""MoE experts that do not fit the device: some kept there for good, the rest in (pinned) host memory.

For a model larger than the GPU budget: each MoE layer has `slots` expert slots on the device. The first
`slots - rotating` experts live there for good (they are never copied again, and have no host copy); the others
stay in host memory, pinned on CUDA, and the `rotating` slots hold the least recently used of them that batches
routed to: copied in on a side stream (so the copies do not block the host), over the least recently used one.
A batch that needs more offloaded experts than there are rotating slots is computed in rounds. Results are
identical to the all-on-device path: the same weights meet the same tokens, only their address changes. An
expert is whatever its stacks hold at its index: float matrices, or GGUF blocks that stay quantized in host
memory too (backend/quant/experts.py).

With routing spread evenly, the device holds `slots` distinct experts either way, so as many copies cross the
bus as with every slot rotating; host memory holds only the experts that are not resident.
"""

from collections import OrderedDict
from collections.abc import Callable

import torch

# compute(x, stacks on the device, topk_weights, topk_ids into those stacks) -> [T, H]
ComputeFn = Callable[[torch.Tensor, list[torch.Tensor], torch.Tensor, torch.Tensor], torch.Tensor]


class ExpertCache:
    def __init__(self, stacks: list[torch.Tensor], slots: int, rotating: int, device: torch.device,
                 compute: ComputeFn):
        num_experts = stacks[0].shape[0]
        if not slots >= 1:
            raise ValueError(f"moe_gpu_experts must be >= 1, got {slots}")
        self.num_experts = num_experts
        self.slots = min(slots, num_experts)
        self.resident = self.slots - max(1, min(rotating, self.slots))  # experts [0, resident) never move
        self.compute_fn = compute
        pin = device.type == "cuda"
        self.device = device
        self.dev = [torch.empty((self.slots, *s.shape[1:]), dtype=s.dtype, device=device) for s in stacks]
        for dev, s in zip(self.dev, stacks):
            dev[:self.resident].copy_(s[:self.resident])
        # One layer's offloaded experts at a time: the stacks they come from are released by the caller.
        self.host = [s[self.resident:].detach().to("cpu").contiguous() for s in stacks]
        if pin:
            self.host = [s.pin_memory() for s in self.host]
        self.slot_of: OrderedDict[int, int] = OrderedDict()  # offloaded expert -> slot, least recently used first
        self.stream = torch.cuda.Stream(device) if pin else None
        self.hits = 0
        self.misses = 0

    def host_bytes(self) -> int:
        return sum(s.numel() * s.element_size() for s in self.host)

    def to(self, device: torch.device) -> "ExpertCache":
        self.device = torch.device(device)
        self.dev = [s.to(device) for s in self.dev]
        return self

    def _copy(self, slot: int, expert: int, non_blocking: bool) -> None:
        for dev, host in zip(self.dev, self.host):
            dev[slot].copy_(host[expert - self.resident], non_blocking=non_blocking)

    def load(self, experts: list[int]) -> dict[int, int]:
        """Make these experts resident (at most `slots - resident` offloaded ones); returns expert -> slot."""
        wanted = set(experts)
        missing = []
        for e in experts:
            if e < self.resident:
                self.hits += 1
            elif e in self.slot_of:
                self.slot_of.move_to_end(e)
                self.hits += 1
            else:
                missing.append(e)
        used = set(self.slot_of.values())
        free = [s for s in range(self.resident, self.slots) if s not in used]
        if self.stream is not None and missing:
            # The slots about to be overwritten may still be read by kernels queued on the compute stream
            # (an earlier round of this batch, the previous batch): the copies start after them.
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
        for e in missing:
            if free:
                slot = free.pop()
            else:
                victim = next(v for v in self.slot_of if v not in wanted)
                slot = self.slot_of.pop(victim)
            self.slot_of[e] = slot
            self.misses += 1
            if self.stream is not None:
                with torch.cuda.stream(self.stream):
                    self._copy(slot, e, non_blocking=True)
            else:
                self._copy(slot, e, non_blocking=False)
        if self.stream is not None and missing:
            torch.cuda.current_stream(self.device).wait_stream(self.stream)
        return {e: e if e < self.resident else self.slot_of[e] for e in experts}

    def compute(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """The MoE output for x, copying offloaded experts in as needed: the resident experts with the first
        round, then as many offloaded ones per round as there are rotating slots."""
        active = torch.unique(topk_ids).tolist()
        kept = [e for e in active if e < self.resident]
        offloaded = [e for e in active if e >= self.resident]
        per_round = self.slots - self.resident
        rounds = [offloaded[i:i + per_round] for i in range(0, len(offloaded), per_round)] or [[]]
        rounds[0] = kept + rounds[0]
        out = torch.zeros_like(x)
        for group in rounds:
            slots = self.load(group)
            remap = torch.full((self.num_experts,), -1, dtype=torch.long, device=topk_ids.device)
            remap[torch.tensor(group, dtype=torch.long, device=topk_ids.device)] = torch.tensor(
                [slots[e] for e in group], dtype=torch.long, device=topk_ids.device)
            ids = remap[topk_ids]
            present = ids >= 0
            # Pairs whose expert is in another round weigh zero here (their slot id is any valid one).
            out += self.compute_fn(x, self.dev, topk_weights * present, ids.clamp(min=0))
        return out
