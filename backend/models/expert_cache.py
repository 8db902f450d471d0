"""MoE experts kept in (pinned) host memory, with a least-recently-used set of them on the device.

For a model larger than the GPU budget: each MoE layer keeps `slots` experts resident; the experts a
batch routes to are copied in (on a side stream from pinned memory, so the copies do not block
the host) over the least recently used ones, and a batch that needs more experts than there are
slots is computed in rounds. Results are identical to the all-on-device path: the same weights
meet the same tokens, only their address changes.
"""

from collections import OrderedDict

import torch

from backend.kernels.moe import fused_moe


class ExpertCache:
    def __init__(self, w_gate_up: torch.Tensor, w_down: torch.Tensor, slots: int, device: torch.device):
        num_experts = w_gate_up.shape[0]
        if not slots >= 1:
            raise ValueError(f"moe_gpu_experts must be >= 1, got {slots}")
        self.slots = min(slots, num_experts)
        pin = device.type == "cuda"
        self.host_gate_up = w_gate_up.detach().to("cpu").contiguous()
        self.host_down = w_down.detach().to("cpu").contiguous()
        if pin:
            self.host_gate_up, self.host_down = self.host_gate_up.pin_memory(), self.host_down.pin_memory()
        self.device = device
        self.dev_gate_up = torch.empty((self.slots, *w_gate_up.shape[1:]), dtype=w_gate_up.dtype, device=device)
        self.dev_down = torch.empty((self.slots, *w_down.shape[1:]), dtype=w_down.dtype, device=device)
        self.slot_of: OrderedDict[int, int] = OrderedDict()  # expert -> slot, least recently used first
        self.stream = torch.cuda.Stream(device) if pin else None
        self.hits = 0
        self.misses = 0

    def to(self, device: torch.device) -> "ExpertCache":
        self.device = torch.device(device)
        self.dev_gate_up = self.dev_gate_up.to(device)
        self.dev_down = self.dev_down.to(device)
        return self

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
                    self.dev_gate_up[slot].copy_(self.host_gate_up[e], non_blocking=True)
                    self.dev_down[slot].copy_(self.host_down[e], non_blocking=True)
            else:
                self.dev_gate_up[slot].copy_(self.host_gate_up[e])
                self.dev_down[slot].copy_(self.host_down[e])
        if self.stream is not None and missing:
            torch.cuda.current_stream(self.device).wait_stream(self.stream)
        return {e: self.slot_of[e] for e in experts}

    def compute(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """The MoE output for x, loading experts as needed, in rounds of at most `slots` experts."""
        active = torch.unique(topk_ids).tolist()
        out = torch.zeros_like(x)
        num_experts = self.host_gate_up.shape[0]
        for start in range(0, len(active), self.slots):
            group = active[start:start + self.slots]
            slots = self.load(group)
            remap = torch.full((num_experts,), -1, dtype=torch.long, device=topk_ids.device)
            remap[torch.tensor(group, device=topk_ids.device)] = torch.tensor([slots[e] for e in group],
                                                                               device=topk_ids.device)
            ids = remap[topk_ids]
            present = ids >= 0
            # Pairs whose expert is in another round weigh zero here (their slot id is any valid one).
            out += fused_moe(x, self.dev_gate_up, self.dev_down, topk_weights * present, ids.clamp(min=0))
        return out
