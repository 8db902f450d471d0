"""MoE experts split between the device and the host, each computed where it lives (moe_cpu_compute; llama.cpp's
--n-cpu-moe way). The first `slots` experts of a layer stay on the device for good; the rest stay in host memory,
repacked for the CPU's kernels, and the CPU computes them for the tokens routed to them while the device computes
the resident ones. Only the tokens' hidden rows and the host experts' weighted sums cross the bus, never weights.

Why, on paper (Mixtral-8x7B Q4_K_M, 6 of 8 experts a layer on a 24 GB card, one token): an expert is ~100 MB;
ExpertCache copies each offloaded expert a token routes to over PCIe 4.0 x16 (~25 GB/s: ~4 ms), where the CPU
reads the same bytes from a desktop's DDR5 (~60 GB/s: ~1.7 ms) to compute it. A batch whose tokens share an
offloaded expert pays one copy for all of them, but the CPU's work grows with the tokens: copying (ExpertCache)
stays the default until a device measures both.

Results are the all-on-device computation's up to rounding: the host's experts run in fp32 (the CPU kernels'
arithmetic), the device's in the model's dtype, and each token's sum adds the host's share last.
"""

from collections.abc import Callable

import torch

from backend.models.expert_cache import ComputeFn

# host(x [P, H] fp32, weights [P, 1] fp32, ids [P, 1] into the host's experts) -> [P, H] fp32, on the CPU
HostFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class SplitExperts:
    def __init__(self, stacks: list[torch.Tensor], slots: int, device: torch.device, compute: ComputeFn,
                 host: HostFn, host_bytes: int):
        if not slots >= 1:
            raise ValueError(f"moe_gpu_experts must be >= 1, got {slots}")
        self.num_experts = stacks[0].shape[0]
        self.slots = min(slots, self.num_experts)
        self.device = device
        self.dev = [s[:self.slots].to(device, copy=True) for s in stacks]
        self.compute_fn, self.host_fn, self._host_bytes = compute, host, host_bytes
        self.host_pairs = 0  # (token, expert) pairs the host computed, for the bench

    def host_bytes(self) -> int:
        return self._host_bytes

    def to(self, device: torch.device) -> "SplitExperts":
        self.device = torch.device(device)
        self.dev = [s.to(device) for s in self.dev]
        return self

    def compute(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """The MoE output for x: the device's experts on the device, queued first; the host's on the CPU meanwhile
        (the host waits only for the routing and the rows it needs), added once both are done."""
        ids_h, weights_h, x_h, ready = _to_host(topk_ids, topk_weights, x)
        on_host = topk_ids >= self.slots
        # the host's pairs weigh zero on the device (their slot id is any valid one)
        out = self.compute_fn(x, self.dev, topk_weights * ~on_host, topk_ids.masked_fill(on_host, 0))
        if ready is not None:
            ready.synchronize()
        tokens, which = (ids_h >= self.slots).nonzero(as_tuple=True)
        if tokens.numel() == 0:
            return out
        self.host_pairs += tokens.numel()
        rows = self.host_fn(x_h[tokens].float(), weights_h[tokens, which][:, None].float(),
                            (ids_h[tokens, which] - self.slots)[:, None])
        host_sum = torch.zeros(x.shape, dtype=torch.float32).index_add_(0, tokens, rows)
        return out + host_sum.to(device=out.device, dtype=out.dtype)


def _to_host(topk_ids: torch.Tensor, topk_weights: torch.Tensor, x: torch.Tensor):
    """(ids, weights, x) in host memory, and on CUDA the event after their copies: pinned buffers copied on the
    compute stream before the device's experts are queued, so waiting for them does not wait for those."""
    if not x.is_cuda:
        return topk_ids, topk_weights, x, None
    copies = []
    for t in (topk_ids, topk_weights, x):
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        host.copy_(t, non_blocking=True)
        copies.append(host)
    ready = torch.cuda.Event()
    ready.record()
    return (*copies, ready)
