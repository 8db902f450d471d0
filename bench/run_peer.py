"""Running a llama.cpp peer script (bench/llama_cpp_*.py) in llama-cpp-python's own venv: the job as JSON on its
stdin, its figures as JSON on its stdout."""

import json
import subprocess
from pathlib import Path


def run_peer(script: str, job: dict, python: str) -> dict:
    """The figures bench/<script> prints for `job`, run by `python` (a venv with llama-cpp-python)."""
    peer = Path(__file__).resolve().parent / script
    done = subprocess.run([python, str(peer)], input=json.dumps(job), capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"the llama.cpp peer failed ({python}): {done.stderr.strip().splitlines()[-1:]}")
    return json.loads(done.stdout)
