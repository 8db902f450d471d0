"""A GGUF's weights as our CPU kernel reads them, kept on disk after the first load and memory-mapped on the
next ones, so that a start does not repack (decode, interleave, reorder) every tensor again: the repack is most
of a load's time (SmolLM2 1 s of 2; a 823 MB MoE file 11 s).

One file per (GGUF file, products): $SCRIPTORIUM_HOME/cache/packed/<stem>-<key>.pt, the key made of the file's
path, size and modification time, the products (arithmetic.products), whether the CPU has AMX tiles and
whether the kernel build has VNNI (the "pairs" and "digits" orders depend on them) and the packing code itself. A
file that changed, or packing code that did, gives another key; an entry that cannot be read or does not match the
model is rebuilt, never used.
"""

import dataclasses
import hashlib
import logging
import os
from pathlib import Path

import torch
from torch import nn

from backend.home import cache_dir
from backend.kernels import native
from backend.quant import cpu_layout, formats, modules
from backend.quant.modules import QuantWeight

log = logging.getLogger(__name__)
PARTS = ("codes", "scales", "offsets")


def _code_version() -> str:
    digest = hashlib.sha256()
    for module in (cpu_layout, formats, modules):
        digest.update(Path(module.__file__).read_bytes())
    return digest.hexdigest()[:16]


def entry_path(gguf: Path, products: str) -> Path:
    stat = gguf.stat()
    identity = (f"{gguf.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|{products}|{native.amx()}|{native.vnni()}|"
                f"{_code_version()}")
    key = hashlib.sha256(identity.encode()).hexdigest()[:20]
    return cache_dir() / "packed" / f"{gguf.stem}-{key}.pt"


def _weights(model: nn.Module) -> dict[str, QuantWeight]:
    return {name: m for name, m in model.named_modules() if isinstance(m, QuantWeight) and m.fmt is not None}


def load(model: nn.Module, path: Path) -> bool:
    """Give every quantized weight its packed tensors from `path` (memory-mapped); False where there is no
    usable entry (the weights are then as they were)."""
    if not path.exists():
        return False
    weights = _weights(model)
    try:
        saved = torch.load(path, mmap=True, weights_only=True)
        layouts, tensors = saved["layouts"], saved["tensors"]
        if set(layouts) != set(weights):
            raise ValueError("its weights are not this model's")
        for name, weight in weights.items():
            expected = {part: tensors[f"{name}.{part}"].shape for part in PARTS if f"{name}.{part}" in tensors}
            if expected["codes"][:len(weight.lead)] != weight.lead:
                raise ValueError(f"{name} has another shape")
    except Exception as e:  # noqa: BLE001 a torn, truncated or foreign file: rebuilt below, never used
        log.warning("packed weights %s cannot be used (%s); repacking", path, e)
        path.unlink(missing_ok=True)
        return False
    for name, weight in weights.items():
        weight.layout = cpu_layout.Layout(**layouts[name])
        for part in PARTS:
            setattr(weight, part, tensors.get(f"{name}.{part}"))
        if not weight.keep_data:
            weight.data = None
    return True


def save(model: nn.Module, path: Path) -> None:
    """Write the packed tensors (a temporary file renamed into place: a reader never sees half of one). A full
    disk or an unwritable home costs the next start its repack, nothing else."""
    weights = _weights(model)
    if not weights or any(w.layout is None for w in weights.values()):
        return
    tensors = {f"{name}.{part}": getattr(w, part) for name, w in weights.items() for part in PARTS
               if getattr(w, part) is not None}
    layouts = {name: dataclasses.asdict(w.layout) for name, w in weights.items()}
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save({"layouts": layouts, "tensors": tensors}, tmp)
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        log.warning("packed weights not kept at %s (%s): the next start repacks them", path, e)
        return
    # Entries of the same file's earlier versions (or other products) beyond the two newest go.
    stem = path.name.rsplit("-", 1)[0]
    entries = sorted(path.parent.glob(f"{stem}-*.pt"), key=lambda p: p.stat().st_mtime, reverse=True)
    for old in entries[2:]:
        old.unlink(missing_ok=True)
