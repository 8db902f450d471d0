"""One file of packed weights (pack_cache.py's entry): b"SCRPACK1", the header's length (8 bytes, little-endian),
a JSON header, then the tensors' bytes from the next 64-byte boundary, each at a 64-byte boundary of its own.

The header says what the entry was made from (the reader compares it with what this load has before using anything
else), how many bytes of tensors follow it (a file of another size was cut short or grown), the weights' layouts
and where each tensor lies. Whatever lies at the path is read as untrusted: opened without following a link or
waiting on a FIFO, used only if it is a regular file, and every length in it checked against the file's size before
anything is read or mapped.
"""

import errno
import json
import math
import mmap
import os
import stat
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from common.files import atomic_write_chunks

MAGIC = b"SCRPACK1"
ALIGN = 64  # the kernels read codes and scales in vector loads
MAX_HEADER = 64 << 20  # a large MoE file's header is a few MB: a larger one is not ours
DTYPES = {
    name: getattr(torch, name)
    for name in ("uint8", "int8", "int16", "int32", "float16", "bfloat16", "float32")
}
_PREFIX = struct.Struct("<8sQ")


class Refused(ValueError):
    """What lies at an entry's path is not used; the message says why, in words for a one-line warning."""


@dataclass
class Entry:
    made_from: dict  # pack_cache.made_from's: the GGUF file, the products and the packing code
    layouts: dict[str, dict]  # weight name -> cpu_layout.Layout's fields
    tensors: dict[str, torch.Tensor]  # "<weight>.<part>" -> its packed tensor


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def write(path: Path, entry: Entry) -> None:
    """Write the entry through a temporary file renamed into place (common.files): a reader sees the old entry or
    the whole new one. OSError where it cannot be written."""
    table, end = {}, 0
    for name, t in entry.tensors.items():
        table[name] = {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape), "offset": end}
        end = _aligned(end + t.numel() * t.element_size())
    header = json.dumps(
        {"made_from": entry.made_from, "layouts": entry.layouts, "tensors": table, "data_bytes": end}
    ).encode()

    def chunks():
        start = _PREFIX.size + len(header)
        yield _PREFIX.pack(MAGIC, len(header)) + header + bytes(_aligned(start) - start)
        for t in entry.tensors.values():
            data = t.detach().contiguous().view(-1).view(torch.uint8).numpy()
            yield memoryview(data)
            yield bytes(_aligned(len(data)) - len(data))

    atomic_write_chunks(path, chunks())


def read(path: Path, made_from: dict) -> Entry | None:
    """The entry at path, its tensors mapped (copy-on-write: nothing written to them reaches the file); None where
    nothing is there. Refused where what is there is not a whole entry made from `made_from`."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise Refused(
            "it is a symbolic link" if e.errno == errno.ELOOP else f"it cannot be opened ({e.strerror})"
        ) from None
    try:
        size = _regular_size(fd)
        header, data_start = _header(fd, size)
        if header.get("made_from") != made_from:
            raise Refused(_difference(header.get("made_from"), made_from))
        if header.get("data_bytes") != size - data_start:
            raise Refused(
                f"it is {size} bytes, not the {data_start} + {header.get('data_bytes')!r} its header says "
                "(cut short?)"
            )
        table = _table(header.get("tensors"), size - data_start)
        layouts = header.get("layouts")
        if not isinstance(layouts, dict):
            raise Refused("its header has no layouts")
        mapped = mmap.mmap(fd, size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    except OSError as e:
        raise Refused(f"it cannot be read ({e.strerror or e})") from None
    finally:
        os.close(fd)
    tensors = {}
    for name, (dtype, shape, offset) in table.items():
        count = math.prod(shape)
        tensors[name] = (
            torch.frombuffer(mapped, dtype=dtype, count=count, offset=data_start + offset).view(shape)
            if count
            else torch.empty(shape, dtype=dtype)
        )
    return Entry(made_from, layouts, tensors)


def _regular_size(fd: int) -> int:
    info = os.fstat(fd)
    kind = stat.S_IFMT(info.st_mode)
    if kind != stat.S_IFREG:
        named = {stat.S_IFDIR: "a directory", stat.S_IFIFO: "a FIFO", stat.S_IFSOCK: "a socket"}
        raise Refused(f"it is {named.get(kind, 'a device')}, not a file")
    return info.st_size


def _pread(fd: int, n: int, offset: int) -> bytes:
    parts = []
    while n:
        part = os.pread(fd, min(n, 1 << 24), offset)
        if not part:
            raise Refused("it ends inside its header (cut short?)")
        parts.append(part)
        n, offset = n - len(part), offset + len(part)
    return b"".join(parts)


def _header(fd: int, size: int) -> tuple[dict, int]:
    if size < _PREFIX.size:
        raise Refused("it is too short to be an entry (cut short?)")
    magic, length = _PREFIX.unpack(_pread(fd, _PREFIX.size, 0))
    if magic != MAGIC:
        raise Refused("it is not a packed-weights entry")
    if length > min(MAX_HEADER, size - _PREFIX.size):
        raise Refused(f"its header's length ({length} bytes) runs past its end (cut short?)")
    try:
        header = json.loads(_pread(fd, length, _PREFIX.size))
    except ValueError as e:  # JSON or UTF-8
        raise Refused(f"its header is not readable ({e})") from None
    if not isinstance(header, dict):
        raise Refused("its header is not one this code writes")
    return header, _aligned(_PREFIX.size + length)


def _difference(theirs, ours: dict) -> str:
    if not isinstance(theirs, dict):
        return "it does not say what it was made from"
    keys = ([k for k in ours if theirs.get(k) != ours[k]] or sorted(set(theirs) - set(ours)))[:3]
    return "it was made from another " + ", ".join(
        f"{k if k in ours else _short(k)} ({_short(theirs.get(k))}, not {_short(ours.get(k))})" for k in keys
    )


def _short(value) -> str:
    text = repr(value)  # the header is not ours: repr keeps a planted newline from breaking the line
    return text if len(text) <= 80 else text[:77] + "..."


def _is_count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _table(tensors, data_bytes: int) -> dict[str, tuple[torch.dtype, list[int], int]]:
    """Each tensor's (dtype, shape, offset in the data), every one inside the data."""
    if not isinstance(tensors, dict):
        raise Refused("its header has no tensor table")
    table = {}
    for name, spec in tensors.items():
        if not isinstance(spec, dict) or spec.get("dtype") not in DTYPES:
            raise Refused(f"its tensor {_short(name)} has no type this code writes")
        shape, offset, dtype = spec.get("shape"), spec.get("offset"), DTYPES[spec["dtype"]]
        if not (
            isinstance(shape, list)
            and all(map(_is_count, shape))
            and _is_count(offset)
            and offset % ALIGN == 0
        ):
            raise Refused(f"its tensor {_short(name)} has no shape or place")
        if offset + math.prod(shape) * dtype.itemsize > data_bytes:
            raise Refused(f"its tensor {_short(name)} runs past its end (cut short?)")
        table[name] = (dtype, shape, offset)
    return table
