"""The CPU repack of a GGUF's weights is kept on disk and mapped by the next load (backend/quant/pack_cache.py):
the same outputs as a fresh repack, and an entry that is stale, torn or another model's is never used."""

import logging
import os

import pytest

from backend import LLM, SamplingParams
from backend.quant import cpu_layout, pack_cache
from backend.quant.modules import QuantWeight
from tests.backend.conftest import prompts_of_lengths

pytestmark = pytest.mark.skipif(not cpu_layout.enabled(), reason="no C compiler for the CPU kernels")
PARAMS = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=3)
PROMPTS = prompts_of_lengths(5, 30)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setattr(pack_cache, "cache_dir", lambda: tmp_path)
    return tmp_path / "packed"


def outputs(path, activations: str = "float32") -> list:
    return [
        (o.outputs[0].token_ids, o.outputs[0].logprobs)
        for o in LLM(str(path), block_size=16, activations=activations).generate(
            PROMPTS, PARAMS, use_tqdm=False
        )
    ]


def no_repacking(monkeypatch):
    def refuse(self, products="float32"):
        raise AssertionError(f"{self} was repacked, not read from the cache")

    monkeypatch.setattr(QuantWeight, "pack_for_cpu", refuse)


@pytest.mark.parametrize(
    "family, activations", [("llama", "float32"), ("qwen3_moe", "float32"), ("qwen3_moe", "int8")]
)
def test_a_second_load_maps_the_first_ones_repack(family, activations, tiny_gguf, cache, monkeypatch):
    """int8: expert stacks in quad order, 8-bit codes as "bits 7", kept in the entry's layouts."""
    path = tiny_gguf(family)[0]
    fresh = outputs(path, activations)
    [entry] = cache.glob("*.packed")
    with monkeypatch.context() as m:
        no_repacking(m)
        assert outputs(path, activations) == fresh


def test_a_changed_file_gets_a_new_entry(tiny_gguf, cache, monkeypatch):
    path = tiny_gguf("llama")[0]
    fresh = outputs(path)
    [old] = cache.glob("*.packed")
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # as a rewritten file would
    assert pack_cache.entry_path(path, "float32") != old
    assert outputs(path) == fresh
    assert len(list(cache.glob("*.packed"))) == 2


def test_a_torn_or_foreign_entry_is_rebuilt_never_used(tiny_gguf, cache, caplog):
    path, other = tiny_gguf("llama")[0], tiny_gguf("qwen3_moe")[0]
    fresh = outputs(path)
    entry = pack_cache.entry_path(path, "float32")
    entry.write_bytes(entry.read_bytes()[: entry.stat().st_size // 2])  # a write cut short
    with caplog.at_level(logging.WARNING, logger="backend.quant.pack_cache"):
        assert outputs(path) == fresh
    assert "not used: it is" in caplog.text and "cut short" in caplog.text and entry.stat().st_size > 0
    outputs(other)
    pack_cache.entry_path(other, "float32").replace(entry)  # another model's repack under this file's key
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="backend.quant.pack_cache"):
        assert outputs(path) == fresh
    assert "made from another file" in caplog.text
