"""Running a llama.cpp peer script (bench/llama_cpp_*.py) in llama-cpp-python's own venv: the job as JSON on its
stdin, its figures as JSON on its stdout."""

import json
import os
import signal
import subprocess
from pathlib import Path

WITHOUT_EXTRA_BUFFERS = "off: llama.cpp's AMX path crashed (SIGSEGV), so the weights stayed in its plain CPU layout"


def run_peer(script: str, job: dict, python: str) -> dict:
    """The figures bench/<script> prints for `job`, run by `python` (a venv with llama-cpp-python). Where llama.cpp
    crashes in its extra buffer types (bench/llama_cpp_open.py), the job is run again without them, and the figures
    say so under "extra_buffers"."""
    peer = Path(__file__).resolve().parent / script
    done = subprocess.run([python, str(peer)], input=json.dumps(job), capture_output=True, text=True)
    crashed = done.returncode == -signal.SIGSEGV
    if crashed:
        env = {**os.environ, "LLAMA_CPP_EXTRA_BUFTS": "0"}
        done = subprocess.run([python, str(peer)], input=json.dumps(job), capture_output=True, text=True, env=env)
    if done.returncode != 0:
        last = done.stderr.strip().splitlines()[-1:] or [f"exit status {done.returncode}, nothing on stderr"]
        raise SystemExit(f"the llama.cpp peer failed ({python}): {last[0]}")
    figures = json.loads(done.stdout)
    return {**figures, "extra_buffers": WITHOUT_EXTRA_BUFFERS} if crashed else figures
