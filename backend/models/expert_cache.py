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

Copies ahead: a layer linked to the next MoE layer's cache (link_next) guesses that layer's routing from its own
input, the residual stream as the next router will see it but before this layer and the next attention add to it,
and copies the guessed offloaded experts in on the next cache's stream while this layer and the next attention
compute. A right guess turns the next layer's copy into a hit; a wrong one costs bus time only, never results: what
a layer computes depends on its own routing alone. The guess is read with this layer's routing, in one host sync.
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
        if self.stream is not None:  # copies ahead may outlive a step: the slots' memory waits for them when freed
            for dev in self.dev:
                dev.record_stream(self.stream)
        self.hits = 0
        self.misses = 0  # copies a batch waited for
        self.prefetched = 0  # copies made ahead, on a guess
        self.prefetch_hits = 0  # of those, the ones a batch then used
        self.ahead: set[int] = set()  # experts copied ahead and not used yet
        self.ahead_copied = torch.cuda.Event() if pin else None  # after the copies ahead
        self.slots_read = torch.cuda.Event() if pin else None  # after the last kernels that read the slots
        self.next: tuple[torch.Tensor, int, ExpertCache] | None = None  # (guess weight, top_k, next layer's cache)

    def host_bytes(self) -> int:
        return sum(s.numel() * s.element_size() for s in self.host)

    def to(self, device: torch.device) -> "ExpertCache":
        if self.stream is not None:  # copies ahead still landing in the slots about to move
            self.stream.synchronize()
        self.device = torch.device(device)
        self.dev = [s.to(device) for s in self.dev]
        if self.next is not None:
            self.next = (self.next[0].to(device), *self.next[1:])
        return self

    def link_next(self, guess_weight: torch.Tensor, top_k: int, cache: "ExpertCache") -> None:
        """Guess the routing of `cache`'s layer from this layer's input x: top_k of x @ guess_weight.T (the next
        router with the next norm's weights in place of this one's: backend/loader.py), and copy ahead."""
        self.next = (guess_weight.to(self.device), top_k, cache)

    def _copy_in(self, experts: list[int], keep: set[int]) -> None:
        """Copy these offloaded experts to free slots, or over the least recently used experts not in `keep`; on
        the side stream on CUDA."""
        used = set(self.slot_of.values())
        free = [s for s in range(self.resident, self.slots) if s not in used]
        for e in experts:
            if free:
                slot = free.pop()
            else:
                victim = next(v for v in self.slot_of if v not in keep)
                slot = self.slot_of.pop(victim)
                self.ahead.discard(victim)
            self.slot_of[e] = slot
            with torch.cuda.stream(self.stream):  # None: no-op
                for dev, host in zip(self.dev, self.host):
                    dev[slot].copy_(host[e - self.resident], non_blocking=self.stream is not None)

    def load(self, experts: list[int]) -> dict[int, int]:
        """Make these experts resident (at most `slots - resident` offloaded ones); returns expert -> slot."""
        wanted = set(experts)
        missing = []
        used_ahead = False
        for e in experts:
            if e < self.resident:
                self.hits += 1
            elif e in self.slot_of:
                self.slot_of.move_to_end(e)
                self.hits += 1
                if e in self.ahead:
                    self.ahead.discard(e)
                    self.prefetch_hits += 1
                    used_ahead = True
            else:
                missing.append(e)
        if used_ahead and self.stream is not None:
            torch.cuda.current_stream(self.device).wait_event(self.ahead_copied)
        if self.stream is not None and missing:
            # The slots about to be overwritten may still be read by kernels queued on the compute stream
            # (an earlier round of this batch, the previous batch): the copies start after them.
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
        self._copy_in(missing, wanted)
        self.misses += len(missing)
        if self.stream is not None and missing:
            torch.cuda.current_stream(self.device).wait_stream(self.stream)
        return {e: e if e < self.resident else self.slot_of[e] for e in experts}

    def prefetch(self, guessed: list[int]) -> None:
        """Copy in ahead, on the side stream, the offloaded ones of these experts (the likeliest first; as many as
        slots rotate) over the least recently used others. load() waits for these copies only if it uses them."""
        wanted = [e for e in guessed if e >= self.resident][:self.slots - self.resident]
        for e in wanted:
            if e in self.slot_of:
                self.slot_of.move_to_end(e)
        missing = [e for e in wanted if e not in self.slot_of]
        if not missing:
            return
        if self.stream is not None:  # the kernels still to read the slots, from an earlier batch (none: no wait)
            self.stream.wait_event(self.slots_read)
        self._copy_in(missing, set(wanted))
        self.ahead.update(missing)
        self.prefetched += len(missing)
        if self.stream is not None:
            self.ahead_copied.record(self.stream)

    def _routing(self, x: torch.Tensor, topk_ids: torch.Tensor) -> tuple[list[int], list[int]]:
        """The experts this batch routes to, and (linked to a next layer) the experts guessed for it there, the
        likeliest first: both read in one host sync."""
        e = self.num_experts
        counts = torch.bincount(topk_ids.flatten(), minlength=e)
        if self.next is not None:
            weight, top_k, _ = self.next
            guess = torch.topk(x @ weight.T, top_k, dim=-1).indices
            counts = torch.cat([counts, torch.bincount(guess.flatten(), minlength=weight.shape[0])])
        counts = counts.tolist()
        routed = [i for i in range(e) if counts[i]]
        guessed = sorted((i for i in range(len(counts) - e) if counts[e + i]), key=lambda i: -counts[e + i])
        return routed, guessed

    def compute(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """The MoE output for x, copying offloaded experts in as needed: the resident experts with the first
        round, then as many offloaded ones per round as there are rotating slots; then the next layer's guessed
        experts copied ahead."""
        active, guessed = self._routing(x, topk_ids)
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
        if self.stream is not None:
            self.slots_read.record(torch.cuda.current_stream(self.device))
        if self.next is not None:
            self.next[2].prefetch(guessed)
        return out
