"""`python -m backend models pull|list`: the default model is fetched, verified and found by its alias."""

import json
import os
import subprocess
import sys

from backend.model_store import KNOWN_MODELS, pull, resolve
from common.hashing import sha256_file


def run_cli(*args, env=None):
    return subprocess.run([sys.executable, "-m", "backend", *args], capture_output=True, text=True, timeout=300,
                          env={**os.environ, **(env or {})})


def test_pull_is_a_no_op_when_present_and_alias_resolves(smollm2_path):
    before = smollm2_path.stat().st_mtime_ns
    result = run_cli("models", "pull", "smollm2")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str(smollm2_path)
    assert smollm2_path.stat().st_mtime_ns == before
    assert resolve("smollm2") == smollm2_path
    assert sha256_file(smollm2_path) == KNOWN_MODELS["smollm2"].sha256


def test_list_json(smollm2_path):
    result = run_cli("models", "list", "--json")
    assert result.returncode == 0, result.stderr
    rows = {row["alias"]: row for row in json.loads(result.stdout)["models"]}
    assert rows["smollm2"]["present"] is True and rows["smollm2"]["path"] == str(smollm2_path)


def test_a_damaged_file_is_fetched_again(tmp_path, monkeypatch):
    monkeypatch.setenv("SCRIPTORIUM_HOME", str(tmp_path))
    target = KNOWN_MODELS["smollm2"].path()
    target.parent.mkdir(parents=True)
    target.write_bytes(b"not the model")
    assert pull("smollm2", quiet=True) == target
    assert sha256_file(target) == KNOWN_MODELS["smollm2"].sha256
    assert list(target.parent.iterdir()) == [target]  # nothing half-written left behind


def test_cli_errors_are_one_line_and_nonzero(tmp_path):
    result = run_cli("models", "pull", "gpt-9")
    assert result.returncode == 2
    assert result.stderr.strip() == "error: unknown model 'gpt-9'; known models: smollm2"
    result = run_cli("generate", "--model", "smollm2", "hi", env={"SCRIPTORIUM_HOME": str(tmp_path)})
    assert result.returncode == 2
    assert "not downloaded yet; run: python -m backend models pull smollm2" in result.stderr
