"""The peak of the bytes that tensors made inside a block of code hold at once, traced op by op (a TorchDispatchMode
sees every tensor torch makes, which tracemalloc does not): what an estimate of a layer's activations is checked
against."""

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class LiveBytes(TorchDispatchMode):
    """Inside `with LiveBytes() as live:`, live.peak is the most bytes that the storages made in the block held at
    once; storages that existed before (weights, the cache, the inputs) and views or in-place writes of them are
    not counted."""

    def __init__(self):
        super().__init__()
        self.holders: dict[int, list[int]] = {}  # storage address -> [tensors holding it, its bytes]
        self.live = 0
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        with self:  # a composite op (attention, linear) as the ops it runs, whose tensors are held meanwhile
            out = func.decompose(*args, **(kwargs or {}))
        if out is NotImplemented:
            out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in _tensors((args, kwargs))}
        for t in _tensors(out):
            address = t.untyped_storage().data_ptr()
            if address == 0 or (address in inputs and address not in self.holders):
                continue  # empty, or a view of what the block did not make
            held = self.holders.setdefault(address, [0, t.untyped_storage().nbytes()])
            if held[0] == 0:
                self.live += held[1]
                self.peak = max(self.peak, self.live)
            held[0] += 1
            weakref.finalize(t, self._release, address)
        return out

    def _release(self, address: int) -> None:
        held = self.holders[address]
        held[0] -= 1
        if held[0] == 0:
            self.live -= held[1]
            del self.holders[address]


def _tensors(tree) -> list[torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, (list, tuple)):
        return [t for item in tree for t in _tensors(item)]
    if isinstance(tree, dict):
        return [t for item in tree.values() for t in _tensors(item)]
    return []
