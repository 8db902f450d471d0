"""Prompts kept across restarts: the prefix cache's full blocks written to disk and loaded on a later hit.

Each block is one file, $SCRIPTORIUM_HOME/cache/kv/<setup>/<chain hash>.kv, in pack_file.py's format: a header
saying what it was made from, then the block's keys and values of every layer. <setup> is a digest of what decides
the bytes of K and V for given tokens (the key): the model file's identity (path, size, modification time), the
device, dtype, products and quantization, the KV cache's dtype, the RoPE settings as served, the block size and
the cache's shapes. The name only finds an entry: its header holds the whole key plus the block's chain hash, its
parent's and its tokens, and is compared with the lookup's before a byte of it is used, so a torn file, another
model's entry renamed in, a link, a FIFO or a directory at the path is ignored with one warning and the tokens are
computed as if nothing were there.

Written off the request path: when a sequence's blocks are freed (block_manager.free_sequence), the blocks not
yet on disk are copied out of the cache on the engine thread and written by disk_kv_writer.py's thread. Read on
a hit: find_cached_prefix goes on past the blocks found in memory, and each block found on disk is loaded into a
free block that joins the in-memory prefix cache; its tokens count as cached (num_cached_tokens). The cache is
bounded by EngineConfig.disk_cache_bytes (serve --disk-cache-bytes; 0 turns it off), least recently used out.
"""

import contextlib
import hashlib
import json
import logging
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from backend.engine.block_manager import chain_hash
from backend.engine.disk_kv_writer import DiskWriter, Job
from backend.home import cache_dir
from backend.quant import pack_file
from backend.quant.pack_file import Refused

if TYPE_CHECKING:
    from backend.config import EngineConfig
    from backend.engine.model_runner import ModelRunner
    from backend.loader import ModelSource
    from backend.model_config import ModelConfig

log = logging.getLogger(__name__)
FORMAT = 1  # of the key and the entries; a new one starts a new setup directory
SUFFIX = ".kv"
MAX_HEADER = 64 << 10  # the key, the block's tokens and the tensor table take a few KB
TOUCH_AFTER = 60.0  # seconds: an entry used again is marked used at most this often


def entry_name(h: int) -> str:
    return f"{h & 0xFFFFFFFFFFFFFFFF:016x}{SUFFIX}"


class DiskPrefixCache:
    def __init__(self, root: Path, key: dict, max_bytes: int, runner: "ModelRunner"):
        self.key = json.loads(json.dumps(key))  # as a header reads back: lists, not tuples
        self.directory = root / hashlib.sha256(json.dumps(self.key, sort_keys=True).encode()).hexdigest()[:24]
        self.runner = runner
        self.layout = [(list(shape), dtype) for shape, dtype in kv_block_layout(runner)]
        self.names = [f"{'kv'[i % 2]}{i // 2}" for i in range(len(self.layout))]  # k0, v0, k1, v1, ...
        self.block_bytes = sum(torch.Size(s).numel() * d.itemsize for s, d in self.layout)
        self.used: dict[
            int, float
        ] = {}  # hash of an entry on disk -> when it was last marked used (0: unknown)
        self.pending: set[int] = set()  # handed to the writer, not written yet
        self.loaded_tokens = 0  # tokens served from disk
        self.writer = DiskWriter(root, max_bytes, self._removed)
        with contextlib.suppress(OSError):  # no directory yet
            self.used = {int(p.stem, 16): 0.0 for p in self.directory.iterdir() if _is_entry_name(p.name)}

    def flush(self, timeout: float | None = None) -> bool:
        """Wait for the queued writes (tests, benches, a restart in the same process)."""
        return self.writer.flush(timeout)

    # Reading: on the engine thread, when the scheduler looks up a prefix ------------------------------------

    def load(
        self, token_ids: list[int], start: int, end: int, parent: int | None, size: int
    ) -> Iterator[tuple[int, tuple[int, ...], list[torch.Tensor]]]:
        """(hash, tokens, K and V of each layer) of blocks start, start + 1, ... (before end) found on disk, in
        order, until the first that is not there or not usable."""
        for i in range(start, end):
            tokens = tuple(token_ids[i * size : (i + 1) * size])
            h = chain_hash(parent, tokens)
            if _unsigned(h) not in self.used:
                return
            data = self._read(_unsigned(h), parent, tokens)
            if data is None:
                return
            self.loaded_tokens += size
            self._mark_used(_unsigned(h))
            yield h, tokens, data
            parent = h

    def write_block(self, block_id: int, data: list[torch.Tensor]) -> None:
        set_kv_block(self.runner, block_id, data)

    def _read(self, h: int, parent: int | None, tokens: tuple[int, ...]) -> list[torch.Tensor] | None:
        path = self.directory / entry_name(h)
        try:
            size = os.lstat(path).st_size
            if size > self.block_bytes + MAX_HEADER:  # an entry's size is known: a larger file is not one
                raise Refused(
                    f"it is {size} bytes, more than an entry of this cache ({self.block_bytes} + header)"
                )
            entry = pack_file.read(path, self._made_from(parent, tokens))
            if entry is None:  # evicted meanwhile
                self.used.pop(h, None)
                return None
            return self._tensors(entry)
        except FileNotFoundError:  # evicted meanwhile
            self.used.pop(h, None)
            return None
        except Exception as e:  # noqa: BLE001 whatever lies there, the prompt is computed instead
            reason = str(e) if isinstance(e, Refused) else f"{type(e).__name__}: {e}"
            log.warning("disk prefix cache: %s not used: %s; its tokens are computed again", path, reason)
            self.used.pop(h, None)  # one warning: it is not looked at again (a new write replaces it)
            return None

    def _tensors(self, entry: pack_file.Entry) -> list[torch.Tensor]:
        if set(entry.tensors) != set(self.names):
            raise Refused("its tensors are not this cache's layers")
        out = []
        for name, (shape, dtype) in zip(self.names, self.layout):
            t = entry.tensors[name]
            if list(t.shape) != shape or t.dtype != dtype:
                raise Refused(f"its tensor {name} is {list(t.shape)} {t.dtype}, not {shape} {dtype}")
            out.append(t)
        return out

    # Writing: the engine thread hands over copies; the writer's thread does the rest -----------------------

    def offer(self, token_ids: list[int], hashes: list[int], block_table: list[int], size: int,
              root: int | None = None) -> None:
        """A freed sequence's hashed blocks (hashes[i] is block_table[i]'s, the first's parent `root`): those not on
        disk are copied and queued to be written; those on disk are marked used."""
        new = []
        for i, h in enumerate(hashes):
            key = _unsigned(h)
            if key in self.used:
                self._mark_used(key)
            elif key not in self.pending:
                new.append(i)
        new = new[: self.writer.room() // self.block_bytes]  # a writer that is behind: the rest are not kept
        if not new:
            return
        copies = kv_blocks(self.runner, [block_table[i] for i in new])
        for j, i in enumerate(new):
            key, parent = _unsigned(hashes[i]), hashes[i - 1] if i else root
            tensors = {name: c[j] for name, c in zip(self.names, copies)}
            job = Job(
                self.directory / entry_name(key),
                self._made_from(parent, tuple(token_ids[i * size : (i + 1) * size])),
                tensors,
                self.block_bytes,
                done=lambda ok, key=key: self._written(key, ok),
            )
            self.pending.add(key)
            if not self.writer.put(job):
                self.pending.discard(key)
                return

    def _made_from(self, parent: int | None, tokens: tuple[int, ...]) -> dict:
        return {**self.key, "parent": parent, "tokens": list(tokens)}

    def _written(self, key: int, ok: bool) -> None:
        self.pending.discard(key)
        if ok:
            self.used[key] = _now()

    def _mark_used(self, key: int) -> None:
        if _now() - self.used.get(key, 0.0) > TOUCH_AFTER:
            self.used[key] = _now()
            self.writer.touch(self.directory / entry_name(key))

    def _removed(self, path: Path) -> None:
        if path.parent == self.directory and _is_entry_name(path.name):
            self.used.pop(int(path.stem, 16), None)


def _unsigned(h: int) -> int:
    return h & 0xFFFFFFFFFFFFFFFF


def _is_entry_name(name: str) -> bool:
    stem = name.removesuffix(SUFFIX)
    return name.endswith(SUFFIX) and len(stem) == 16 and all(c in "0123456789abcdef" for c in stem)


def _cache_tensors(runner: "ModelRunner") -> list[torch.Tensor]:
    """K then V of every attention layer, in order (a model with a sliding group has no disk cache: each tensor's
    block ids are the one pool's)."""
    return [t for layer in runner.model.model.layers for t in (layer.self_attn.k_cache, layer.self_attn.v_cache)]


def kv_block_layout(runner: "ModelRunner") -> list[tuple[torch.Size, torch.dtype]]:
    """Shape and dtype of one block of each cache tensor (_cache_tensors' order)."""
    return [(t.shape[1:], t.dtype) for t in _cache_tensors(runner)]


def kv_blocks(runner: "ModelRunner", block_ids: list[int]) -> list[torch.Tensor]:
    """Copies in host memory of these blocks, one tensor per cache tensor, each (len(block_ids), *its block's
    shape): what is written while the blocks are reused."""
    index = torch.tensor(block_ids, dtype=torch.long, device=runner.device)
    return [t.index_select(0, index).cpu() for t in _cache_tensors(runner)]


def set_kv_block(runner: "ModelRunner", block_id: int, data: list[torch.Tensor]) -> None:
    """Fill one block of every cache tensor with the disk's copy."""
    for target, source in zip(_cache_tensors(runner), data, strict=True):
        target[block_id].copy_(source)


def _now() -> float:
    return time.monotonic()


def model_identity(source: "ModelSource", seed: int | None) -> list:
    """The files the weights come from, each as (path, size, modification time): a replaced file is another model
    (random weights: drawn at load from the seed)."""
    files = (
        [source.gguf_file]
        if source.gguf_file is not None
        else sorted([source.path / "config.json", *source.path.glob("*.safetensors")])
    )
    identity = []
    for f in files:
        info = f.stat()
        identity.append([str(f.resolve()), info.st_size, info.st_mtime_ns])
    if source.random_weights:  # drawn at load from the seed
        identity.append(["random", source.random_format, seed])
    return identity


def for_engine(config: "EngineConfig", source: "ModelSource", mc: "ModelConfig", runner: "ModelRunner",
               products: str, kv_dtype: torch.dtype) -> DiskPrefixCache | None:
    """An engine's disk prefix cache, or None where it is off (disk_cache_bytes 0, no prefix caching, a hybrid
    model's, which takes no prefix hit: engine/state_pool.py, or a model with a sliding group, whose entries would
    need the window's blocks of that group too: engine/cache_groups.py)."""
    if not config.disk_cache_bytes or not config.enable_prefix_caching or runner.state_slots or runner.sliding:
        return None
    layout = kv_block_layout(runner)
    if not layout:
        return None
    key = {
        "format": FORMAT,
        "model": model_identity(source, config.seed),
        "device": runner.device.type,
        "dtype": str(runner.dtype),
        "products": products,
        "quantization": config.quantization,
        "activations": config.activations,
        "kv_dtype": str(kv_dtype),
        "rope_theta": mc.rope_theta,
        "rope_scaling": mc.rope_scaling,
        "rope_switch": [mc.rope_switch_length, mc.short_rope_scaling],
        "block_size": config.block_size,
        "caches": [[list(shape), str(dtype)] for shape, dtype in layout],
    }
    return DiskPrefixCache(cache_dir() / "kv", key, config.disk_cache_bytes, runner)
