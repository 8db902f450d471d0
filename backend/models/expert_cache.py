"""MoE experts kept in (pinned) host memory, with a least-recently-used set of them on the device.

For a model larger than the GPU budget: each MoE layer keeps `slots` experts resident; the experts a
batch routes to are copied in (on a side stream from pinned memory, so the copies do not block
the host) over the least recently used ones, and a batch that needs more experts than there are
slots is computed in rounds. Results are identical to the all-on-device path: the same weights
meet the same tokens, only their address changes. An expert is whatever its stacks hold at its
index: float matrices, or GGUF blocks that stay quantized in host memory too (backend/quant/experts.py).
"""

from collections import OrderedDict
from collections.abc import Callable

import torch

# compute(x, stacks on the device, topk_weights, topk_ids into those stacks) -> [T, H]
ComputeFn = Callable[[torch.Tensor, list[torch.Tensor], torch.Tensor, torch.Tensor], torch.Tensor]


class ExpertCache:
    def __init__(self, stacks: list[torch.Tensor], slots: int, device: torch.device, compute: ComputeFn):
        num_experts = stacks[0].shape[0]
        if not slots >= 1:
            raise ValueError(f"moe_gpu_experts must be >= 1, got {slots}")
        self.num_experts = num_experts
        self.slots = min(slots, num_experts)
        self.compute_fn = compute
        pin = device.type == "cuda"
        self.host = [s.detach().to("cpu").contiguous() for s in stacks]
        if pin:
            self.host = [s.pin_memory() for s in self.host]
        self.device = device
        self.dev = [torch.empty((self.slots, *s.shape[1:]), dtype=s.dtype, device=device) for s in stacks]
        self.slot_of: OrderedDict[int, int] = OrderedDict()  # expert -> slot, least recently used first
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
            dev[slot].copy_(host[expert], non_blocking=non_blocking)

    def load(self, experts: list[int]) -> dict[int, int]:
        """Make these experts (at most `slots`) resident; returns expert -> slot."""
        wanted = set(experts)
        missing = []
        for e in experts:
            if e in self.slot_of:
                self.slot_of.move_to_end(e)
                self.hits += 1
            else:
                missing.append(e)
        free = [s for s in range(self.slots) if s not in self.slot_of.values()]
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
        return {e: self.slot_of[e] for e in experts}

    def compute(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """The MoE output for x, loading experts as needed, in rounds of at most `slots` experts."""
        active = torch.unique(topk_ids).tolist()
        out = torch.zeros_like(x)
        for start in range(0, len(active), self.slots):
            group = active[start:start + self.slots]
            slots = self.load(group)
            remap = torch.full((self.num_experts,), -1, dtype=torch.long, device=topk_ids.device)
            remap[torch.tensor(group, device=topk_ids.device)] = torch.tensor([slots[e] for e in group],
                                                                               device=topk_ids.device)
            ids = remap[topk_ids]
            present = ids >= 0
            # Pairs whose expert is in another round weigh zero here (their slot id is any valid one).
            out += self.compute_fn(x, self.dev, topk_weights * present, ids.clamp(min=0))
        return out
