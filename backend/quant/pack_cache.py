"""A GGUF's weights as our CPU kernel reads them, kept on disk after the first load and memory-mapped on the
next ones, so that a start does not repack (decode, interleave, reorder) every tensor again: the repack is most
of a load's time (SmolLM2 1 s of 2; a 823 MB MoE file 11 s).

One file per (GGUF file, products): $SCRIPTORIUM_HOME/cache/packed/<stem>-<key>.packed (pack_file.py's format),
the key made of the file's path, size and modification time, the products (arithmetic.products), whether the CPU
has AMX tiles and whether the kernel build has VNNI (the "pairs" and "digits" orders depend on them) and the
packing code itself. The name only finds an entry: what the entry was made from is inside it (made_from) and is
compared with this load's before anything in it is used, so another model's entry renamed into place, a torn
one, a link, a directory or a FIFO at the path is refused in one warning and the weights are repacked. Neither a
refused entry nor a cache that cannot be written (read-only, full) fails a load.
"""

import contextlib
import dataclasses
import hashlib
import json
import logging
import math
import os
import re
import stat
from pathlib import Path

from torch import nn

from backend.gguf_file import GGUFFile
from backend.home import cache_dir
from backend.kernels import native
from backend.quant import block_bytes, codebooks, cpu_layout, formats, modules, pack_file
from backend.quant.modules import QuantWeight
from backend.quant.pack_file import Refused

log = logging.getLogger(__name__)
PARTS = ("codes", "scales", "offsets")
SUFFIX = ".packed"
KEEP = 2  # entries kept per GGUF file name (this version of the file and the one before)
_CODE_BITS = cpu_layout.CODE_BITS  # a layout's bits -> the bits each weight's code takes in `codes`


def _code_version() -> str:
    digest = hashlib.sha256()
    for module in (block_bytes, codebooks, cpu_layout, formats, modules, pack_file):
        digest.update(Path(module.__file__).read_bytes())
    digest.update(Path(__file__).read_bytes())
    return digest.hexdigest()[:16]


def entry_path(gguf: Path, products: str) -> Path:
    info = gguf.stat()
    identity = (
        f"{gguf.resolve()}|{info.st_size}|{info.st_mtime_ns}|{products}|{native.amx()}|{native.vnni()}|"
        f"{_code_version()}"
    )
    key = hashlib.sha256(identity.encode()).hexdigest()[:20]
    return cache_dir() / "packed" / f"{gguf.stem}-{key}{SUFFIX}"


def made_from(reader: GGUFFile, products: str) -> dict:
    """What an entry for this file and these products holds: the file's identity, a digest of its tensor table
    (names, types, shapes, offsets; not the gigabytes of data), the products, the CPU's and the build's
    features, and the packing code."""
    path = reader.path.resolve()
    st = path.stat()
    records = [
        [t.name, int(t.tensor_type), [int(d) for d in t.shape], int(t.data_offset), int(t.n_bytes)]
        for t in reader.tensors
    ]
    table = hashlib.sha256(json.dumps([reader.version, records]).encode()).hexdigest()
    return {
        "file": str(path),
        "size": st.st_size,
        "mtime_ns": st.st_mtime_ns,
        "inode": st.st_ino,
        "device": st.st_dev,
        "tensor_table": table,
        "products": products,
        "amx": bool(native.amx()),
        "vnni": bool(native.vnni()),
        "code": _code_version(),
    }


def _weights(model: nn.Module) -> dict[str, QuantWeight]:
    return {name: m for name, m in model.named_modules() if isinstance(m, QuantWeight) and m.fmt is not None}


def load(model: nn.Module, path: Path, origin: dict) -> bool:
    """Give every quantized weight its packed tensors from the entry at `path` (memory-mapped), if that entry was
    made from `origin` (made_from's) and fits the model; False, the weights as they were, where it is not (with a
    one-line warning) or where there is none."""
    weights = _weights(model)
    try:
        entry = pack_file.read(path, origin)
        if entry is None:
            return False
        layouts = _fitted(entry, weights)
    except Refused as e:
        log.warning("packed weights %s not used: %s; repacking", path, e)
        return False
    for name, weight in weights.items():
        weight.layout = layouts[name]
        for part in PARTS:
            setattr(weight, part, entry.tensors.get(f"{name}.{part}"))
        if not weight.keep_data:
            weight.data = None
    return True


def _fitted(entry: pack_file.Entry, weights: dict[str, QuantWeight]) -> dict[str, cpu_layout.Layout]:
    """Each weight's layout, where the entry's tensors are this model's (one more check behind made_from: a
    shape that the kernels would read past)."""
    if set(entry.layouts) != set(weights):
        raise Refused("its weights are not this model's")
    layouts = {name: _layout(entry.layouts[name]) for name in weights}
    wanted = {
        f"{name}.{part}"
        for name, layout in layouts.items()
        for part in PARTS
        if part != "offsets" or layout.offsets
    }
    if set(entry.tensors) != wanted:
        raise Refused("its tensors are not this model's weights' parts")
    for name, weight in weights.items():
        codes, bits = entry.tensors[f"{name}.codes"], _CODE_BITS[layouts[name].bits]
        panels = -(-weight.rows // (cpu_layout.PANEL * cpu_layout.TILE_PANELS)) * cpu_layout.TILE_PANELS
        size = math.prod(weight.lead) * panels * cpu_layout.PANEL * weight.cols * bits // 8
        if (
            tuple(codes.shape[: len(weight.lead)]) != weight.lead
            or codes.numel() != size
            or codes.element_size() != 1
        ):
            raise Refused(f"its {name} has another shape than this model's")
    return layouts


def _layout(fields) -> cpu_layout.Layout:
    names = {f.name for f in dataclasses.fields(cpu_layout.Layout)}
    if not isinstance(fields, dict) or set(fields) != names:
        raise Refused("a layout in it is not one this code writes")
    ints = all(
        isinstance(fields[k], int) and not isinstance(fields[k], bool)
        for k in ("bits", "group", "scale_kind")
    )
    if not (
        ints
        and fields["bits"] in _CODE_BITS
        and fields["group"] > 0
        and fields["scale_kind"] >= 0
        and isinstance(fields["offsets"], bool)
        and fields["order"] in cpu_layout.ORDERS
    ):
        raise Refused("a layout in it is not one this code writes")
    return cpu_layout.Layout(**fields)


def save(model: nn.Module, path: Path, origin: dict) -> bool:
    """Keep the packed tensors at `path`, marked as made from `origin`; whether they were kept. A read-only or full
    disk, or something that is not a file in the way (a directory), costs the next start its repack and a
    warning, nothing else."""
    weights = _weights(model)
    if not weights or any(w.layout is None for w in weights.values()):
        return False
    tensors = {
        f"{name}.{part}": getattr(w, part)
        for name, w in weights.items()
        for part in PARTS
        if getattr(w, part) is not None
    }
    layouts = {name: dataclasses.asdict(w.layout) for name, w in weights.items()}
    try:
        pack_file.write(path, pack_file.Entry(origin, layouts, tensors))
    except OSError as e:
        log.warning("packed weights not kept at %s (%s): the next start repacks them", path, e.strerror or e)
        return False
    _prune(path)
    return True


def _prune(path: Path) -> None:
    """Entries of the same file's earlier versions (or other products) beyond the KEEP newest go; only regular
    files named as entries are looked at, and one that cannot be removed stays."""
    stem = path.name.rsplit("-", 1)[0]
    named = re.compile(rf"{re.escape(stem)}-[0-9a-f]{{20}}\.(packed|pt)")  # .pt: this cache's earlier format
    try:
        with os.scandir(path.parent) as listing:
            names = [item.path for item in listing if named.fullmatch(item.name)]
    except OSError:
        return
    entries = []
    for name in names:
        try:
            st = os.lstat(name)
        except OSError:
            continue
        if stat.S_ISREG(st.st_mode):
            entries.append((st.st_mtime_ns, name))
    for _, old in sorted(entries, reverse=True)[KEEP:]:
        with contextlib.suppress(OSError):
            os.unlink(old)
