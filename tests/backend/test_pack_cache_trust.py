"""The packed-weights cache trusts nothing it finds (backend/quant/pack_cache.py, pack_file.py): another model's
entry of the same shapes renamed or linked into place, a directory, a FIFO or a dangling link at the entry's path,
a torn entry on a read-only disk and a full disk are each refused or skipped in a one-line warning, and the load
goes on to the same outputs as the file's own repack: never another model's weights, never a failed or hung load."""

import json
import logging
import os
import shutil
import subprocess
import sys
import threading

import pytest

from backend.quant import cpu_layout, pack_cache
from tests.backend.server_process import ROOT
from tests.backend.test_pack_cache import cache, outputs  # noqa: F401 (cache: a fixture)
from tests.reliability.full_disk import MOUNT_FAILED

pytestmark = [
    pytest.mark.skipif(not cpu_layout.enabled(), reason="no C compiler for the CPU kernels"),
    pytest.mark.usefixtures("cache"),  # each test's own cache directory
]
LOGGER = "backend.quant.pack_cache"


@pytest.fixture
def twins(tiny_gguf, request):
    """Two llama files of the same shapes and formats, their weights drawn from other seeds: (A, B, B's own
    outputs, from its repack in an empty cache)."""
    directory = request.getfixturevalue("cache")
    a, b = tiny_gguf("llama")[0], tiny_gguf("llama", "twin", build={"seed": 1})[0]
    fresh_b = outputs(b)
    for entry in directory.iterdir():
        entry.unlink()
    assert outputs(a) != fresh_b  # else a borrowed entry would go unseen
    return a, b, fresh_b


def one_line_warnings(caplog) -> list[str]:
    lines = [r.getMessage() for r in caplog.records if r.name == LOGGER and r.levelno == logging.WARNING]
    assert all("\n" not in line for line in lines), lines
    return lines


def test_another_models_entry_renamed_into_place_is_refused(twins, caplog):
    a, b, fresh_b = twins
    pack_cache.entry_path(a, "float32").replace(pack_cache.entry_path(b, "float32"))
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert outputs(b) == fresh_b
    [line] = one_line_warnings(caplog)
    assert "not used: it was made from another file" in line and str(a) in line
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert outputs(b) == fresh_b  # the refused entry was replaced by B's own, used without a word
    assert one_line_warnings(caplog) == []


def test_a_link_to_another_models_entry_is_refused(twins, caplog):
    a, b, fresh_b = twins
    entry = pack_cache.entry_path(b, "float32")
    entry.symlink_to(pack_cache.entry_path(a, "float32"))
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert outputs(b) == fresh_b
    assert "not used: it is a symbolic link" in one_line_warnings(caplog)[0]
    assert entry.is_file() and not entry.is_symlink()  # B's own entry took the link's place
    assert pack_cache.entry_path(a, "float32").is_file()  # and nothing was written through it


def test_a_directory_at_the_entry_is_refused_and_left(tiny_gguf, caplog):
    path = tiny_gguf("llama")[0]
    fresh = outputs(path)
    entry = pack_cache.entry_path(path, "float32")
    entry.unlink()
    (entry / "inside").mkdir(parents=True)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert outputs(path) == fresh
    refused, not_kept = one_line_warnings(caplog)
    assert "not used: it is a directory" in refused and "not kept" in not_kept
    assert (entry / "inside").is_dir()


def test_a_fifo_at_the_entry_neither_hangs_nor_is_read(tiny_gguf, caplog):
    path = tiny_gguf("llama")[0]
    fresh = outputs(path)
    entry = pack_cache.entry_path(path, "float32")
    entry.unlink()
    os.mkfifo(entry)
    loaded, hung = threading.Event(), []

    def unblock():  # a reader blocked on the FIFO gets a writer (and EOF) after 30 s: the test fails, not hangs
        if not loaded.wait(30):
            hung.append(True)
            fd = os.open(entry, os.O_WRONLY | os.O_NONBLOCK)
            os.close(fd)

    watchdog = threading.Thread(target=unblock)
    watchdog.start()
    try:
        with caplog.at_level(logging.WARNING, logger=LOGGER):
            assert outputs(path) == fresh
    finally:
        loaded.set()
        watchdog.join()
    assert not hung, "the load waited on the FIFO"
    assert "not used: it is a FIFO" in one_line_warnings(caplog)[0]
    assert entry.is_file()


def test_dangling_links_fail_neither_the_load_nor_the_save(tiny_gguf, caplog, tmp_path):
    path = tiny_gguf("llama")[0]
    fresh = outputs(path)
    entry = pack_cache.entry_path(path, "float32")
    entry.unlink()
    victim = tmp_path / "victim"
    entry.symlink_to(victim)
    older = entry.with_name(f"{path.stem}-{'0' * 20}{entry.suffix}")  # named as an earlier version's entry
    older.symlink_to(tmp_path / "gone")
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert outputs(path) == fresh
    assert "not used: it is a symbolic link" in one_line_warnings(caplog)[0]
    assert entry.is_file() and not entry.is_symlink() and not victim.exists()
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert outputs(path) == fresh  # the entry kept is used


def test_a_read_only_or_full_cache_fails_no_load(tiny_gguf, tmp_path):
    """A real read-only and a real full file system: a tmpfs in a mount namespace (pack_cache_mounts.py)."""
    unshare = shutil.which("unshare")
    if unshare is None:
        pytest.skip("no unshare(1) to make a private mount namespace")
    path = tiny_gguf("llama")[0]
    for flags in ("-m", "-rm"):  # root, then an unprivileged user namespace
        done = subprocess.run(
            [
                unshare,
                flags,
                sys.executable,
                "-m",
                "tests.backend.pack_cache_mounts",
                str(path),
                str(tmp_path / "cache"),
            ],
            capture_output=True,
            text=True,
            cwd=ROOT,
            timeout=300,
        )
        if done.returncode == 0:
            break
        not_let_in = done.returncode == 1 and done.stderr.startswith("unshare:")
        assert done.returncode == MOUNT_FAILED or not_let_in, done.stderr
    else:
        pytest.skip(f"cannot mount a tmpfs in a private namespace here: {done.stderr.strip()[-200:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    first, read_only, full = result["first"], result["read_only"], result["full"]
    assert "outputs" in first and first["warnings"] == [] and len(first["files"]) == 1, first
    assert read_only.get("outputs") == first["outputs"], read_only
    refused, not_kept = read_only["warnings"]
    assert "cut short" in refused and "Read-only file system" in not_kept
    assert read_only["entry_size_after"] > 0
    assert full.get("outputs") == first["outputs"], full
    [not_kept] = full["warnings"]
    assert "No space left on device" in not_kept
    assert full["files"] == []  # the temporary file the full disk cut short is gone too
