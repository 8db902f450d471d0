"""Prompts kept across restarts (engine/disk_prefix_cache.py): real engines writing real files under a temporary
SCRIPTORIUM_HOME, checked against the same engine without the disk cache and against transformers."""

import logging
import os
import shutil

import httpx
import pytest

from backend import LLM, SamplingParams
from backend.engine.block_manager import chain_hash
from backend.engine.disk_prefix_cache import entry_name
from tests.backend.conftest import hf_greedy, prompts_of_lengths
from tests.backend.server_process import ServerProcess

PARAMS = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2)
BLOCK = 8


@pytest.fixture(autouse=True)
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("SCRIPTORIUM_HOME", str(tmp_path))
    return tmp_path


def served(llm: LLM, prompt: list[int], params: SamplingParams = PARAMS):
    out = llm.generate(prompt, params, use_tqdm=False)[0]
    if llm.engine.disk_cache is not None:
        assert llm.engine.disk_cache.flush(60)  # what a process's exit waits for
    return out


def assert_close(out, expected) -> None:
    """The same tokens, and logprobs within float rounding: rows computed in other chunks round differently."""
    assert out.outputs[0].token_ids == expected.outputs[0].token_ids
    for ours, theirs in zip(out.outputs[0].logprobs, expected.outputs[0].logprobs, strict=True):
        assert ours.keys() == theirs.keys()
        assert all(abs(ours[t].logprob - theirs[t].logprob) < 1e-5 for t in ours)


def block_path(llm: LLM, prompt: list[int], index: int):
    parent = None
    for i in range(index + 1):
        parent = chain_hash(parent, tuple(prompt[i * BLOCK : (i + 1) * BLOCK]))
    return llm.engine.disk_cache.directory / entry_name(parent)


def test_a_restarted_engine_loads_the_prompt_from_disk_with_a_cold_runs_tokens_and_logprobs(
    tiny_dir, hf_model
):
    directory = tiny_dir("llama")
    prompt = prompts_of_lengths(101)[0]  # 12 full blocks of 8 and 5 tokens
    first = served(LLM(str(directory), block_size=BLOCK), prompt)
    assert first.num_cached_tokens == 0

    restarted = LLM(str(directory), block_size=BLOCK)
    again = served(restarted, prompt)
    assert again.num_cached_tokens == 96 and restarted.engine.disk_cache.loaded_tokens == 96

    plain = LLM(str(directory), block_size=BLOCK, disk_cache_bytes=0)
    cold, warm = served(plain, prompt), served(plain, prompt)
    assert cold.num_cached_tokens == 0 and warm.num_cached_tokens == 96
    # Bit for bit what the same engine gives from its in-memory prefix cache (the prompt's last 5 tokens computed
    # on top of 96 cached ones); a cold run computes them in one chunk with the rest, which rounds differently
    assert again.outputs[0].token_ids == warm.outputs[0].token_ids
    assert again.outputs[0].logprobs == warm.outputs[0].logprobs
    assert first.outputs[0].logprobs == cold.outputs[0].logprobs
    assert (
        again.outputs[0].token_ids == cold.outputs[0].token_ids == hf_greedy(hf_model(directory), prompt, 8)
    )
    assert_close(again, cold)


def test_a_longer_prompt_loads_the_blocks_past_its_in_memory_hit(tiny_dir):
    directory = tiny_dir("llama")
    prompt = prompts_of_lengths(101)[0]
    served(LLM(str(directory), block_size=BLOCK), prompt)
    llm = LLM(str(directory), block_size=BLOCK)
    assert served(llm, prompt[:40]).num_cached_tokens == 32  # 4 blocks from disk
    longer = prompt + [5, 6, 7]
    out = served(llm, longer)
    # 5 blocks in memory (the short prompt's, its last computed with it), then 7 more from disk
    assert out.num_cached_tokens == 96 and llm.engine.disk_cache.loaded_tokens == 32 + 56
    # The 5th block was computed again here, on top of 4 loaded ones: its keys round otherwise than the first
    # engine's, so the continuation matches the same hit from memory up to rounding
    plain = LLM(str(directory), block_size=BLOCK, disk_cache_bytes=0)
    served(plain, prompt)
    expected = served(plain, longer)
    assert expected.num_cached_tokens == 96
    assert_close(out, expected)


def _torn(path, other):
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)


def _grown(path, other):
    with open(path, "ab") as f:
        f.write(bytes(1 << 20))


def _foreign(path, other):
    shutil.copyfile(other, path)  # another model's entry renamed into place


def _symlink(path, other):
    os.replace(path, path.with_suffix(".moved"))
    os.symlink(path.with_suffix(".moved"), path)  # the right entry, behind a link


def _fifo(path, other):
    path.unlink()
    os.mkfifo(path)


@pytest.mark.parametrize(
    "damage", [_torn, _grown, _foreign, _symlink, _fifo], ids=lambda f: f.__name__.strip("_")
)
def test_a_damaged_entry_is_ignored_with_one_warning_and_recomputed(damage, tiny_dir, caplog):
    directory = tiny_dir("llama")
    prompt = prompts_of_lengths(101)[0]
    writer = LLM(str(directory), block_size=BLOCK)
    first = served(writer, prompt)
    other = LLM(str(tiny_dir("mistral")), block_size=BLOCK)
    served(other, prompts_of_lengths(101)[0])
    path = block_path(writer, prompt, 5)
    damage(path, block_path(other, prompt, 5))

    llm = LLM(str(directory), block_size=BLOCK)
    with caplog.at_level(logging.WARNING, logger="backend.engine.disk_prefix_cache"):
        out = served(llm, prompt)
    warnings = [r.getMessage() for r in caplog.records if "disk prefix cache" in r.getMessage()]
    assert len(warnings) == 1 and str(path) in warnings[0], warnings
    assert out.num_cached_tokens == 40  # blocks 0-4; the 6th and after computed again
    assert_close(out, first)
    assert path.is_file() and not path.is_symlink()  # written again, whole, in place of what was there
    assert served(LLM(str(directory), block_size=BLOCK), prompt).num_cached_tokens == 96


def test_the_size_bound_keeps_the_least_recently_used_out(tiny_dir, home):
    directory = tiny_dir("llama")
    one, two, three = (prompts_of_lengths(97 + k)[0] for k in range(3))  # 12 full blocks each, nothing shared
    params = SamplingParams(temperature=0, max_tokens=1)
    probe = LLM(str(directory), block_size=BLOCK)
    served(probe, one, params)
    root = home / "cache" / "kv"
    sizes = [f.stat().st_size for f in root.rglob("*.kv")]
    assert len(sizes) == 12
    bound = int(27.5 * max(sizes))  # room for two prompts, not three
    shutil.rmtree(root)

    first = LLM(str(directory), block_size=BLOCK, disk_cache_bytes=bound)
    served(first, one, params)
    served(first, two, params)
    restarted = LLM(str(directory), block_size=BLOCK, disk_cache_bytes=bound)
    assert (
        served(restarted, one, params).num_cached_tokens == 96
    )  # used again: now the more recent of the two
    served(restarted, three, params)
    assert sum(f.stat().st_size for f in root.rglob("*.kv")) <= bound
    last = LLM(str(directory), block_size=BLOCK, disk_cache_bytes=bound)
    assert served(last, one, params).num_cached_tokens == 96
    assert served(last, three, params).num_cached_tokens == 96
    assert (
        served(LLM(str(directory), block_size=BLOCK, disk_cache_bytes=bound), two, params).num_cached_tokens
        == 0
    )


def test_off_writes_and_reads_nothing(tiny_dir, home):
    directory = tiny_dir("llama")
    prompt = prompts_of_lengths(101)[0]
    served(LLM(str(directory), block_size=BLOCK), prompt)
    for settings in ({"disk_cache_bytes": 0}, {"enable_prefix_caching": False}):
        llm = LLM(str(directory), block_size=BLOCK, **settings)
        assert llm.engine.disk_cache is None
        assert served(llm, prompt).num_cached_tokens == 0
    shutil.rmtree(home / "cache" / "kv")
    served(LLM(str(directory), block_size=BLOCK, disk_cache_bytes=0), prompt)
    assert not (home / "cache" / "kv").exists()


def test_a_server_swapping_models_and_restarted_serves_the_prompt_from_disk(tiny_dir, home):
    prompt = prompts_of_lengths(101)[0]
    models = (
        f"tiny={tiny_dir('llama')}",
        "--model",
        f"other={tiny_dir('qwen2')}",
        "--max-loaded-models",
        "1",
        "--block-size",
        str(BLOCK),
    )

    def complete(server, model="tiny"):
        r = httpx.post(
            f"{server.url}/v1/completions",
            timeout=120,
            json={
                "model": model,
                "prompt": prompt,
                "max_tokens": 8,
                "temperature": 0,
                "ignore_eos": True,
                "logprobs": 2,
            },
        )
        assert r.status_code == 200, r.text
        body = r.json()
        return body["usage"]["prompt_tokens_details"]["cached_tokens"], body["choices"][0]["logprobs"]

    server = ServerProcess(*models)
    try:
        cold, warm = complete(server), complete(server)
        assert cold[0] == 0 and warm[0] == 96
        complete(server, "other")  # tiny is unloaded to make room
        assert complete(server) == warm  # loaded again: its prompt from disk, bit for bit the in-memory hit's
    finally:
        assert server.stop() == 0
    assert len(list((home / "cache" / "kv").rglob("*.kv"))) == 2 * 13  # each model's prompt and output blocks
    server = ServerProcess(*models)
    try:
        assert complete(server) == warm
    finally:
        assert server.stop() == 0
