"""Load time of a GGUF file, ours beside llama.cpp's, each in a fresh process (what a start or a model swap pays).

Ours: `LLM(path)` (weights, repack or its cache, KV cache, tokenizer) timed inside the process, imports apart,
cold (an empty cache of packed weights: the first start) and warm (the second); llama.cpp: `Llama(model_path)`
in llama-cpp-python's own venv (row null without --llama-cpp-python PATH or LLAMA_CPP_PYTHON). The file's pages
are in the OS cache for both (a first read from disk is the disk's speed, the same for either). One JSON line.

Run: python bench/load.py [--model smollm2|PATH.gguf] [--llama-cpp-python /path/to/venv/bin/python]
"""

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OURS = """
import json, sys, time
start = time.perf_counter()
from backend import LLM
imported = time.perf_counter()
LLM(sys.argv[1], max_model_len=4096)
print(json.dumps({"import_s": imported - start, "load_s": time.perf_counter() - imported}))
"""
PEER = """
import json, sys, time
start = time.perf_counter()
from llama_cpp import Llama
imported = time.perf_counter()
Llama(model_path=sys.argv[1], n_ctx=4096, n_threads=2, verbose=False)
print(json.dumps({"import_s": imported - start, "load_s": time.perf_counter() - imported}))
"""


def timed(python: str, script: str, model: str, env: dict) -> dict:
    done = subprocess.run([python, "-c", script, model], capture_output=True, text=True, cwd=ROOT, env=env,
                          timeout=900)
    if done.returncode:
        sys.exit(f"load failed: {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--llama-cpp-python", default=os.environ.get("LLAMA_CPP_PYTHON"))
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    from backend.model_store import pull
    from backend.quant import pack_cache

    path = str(pull(args.model)) if not args.model.endswith(".gguf") else args.model
    Path(path).read_bytes()  # its pages in the OS cache, for both engines
    # Cold: no packed weights kept for this file yet (the compiled kernels stay: they are built once per CPU).
    pack_cache.entry_path(Path(path), "float32").unlink(missing_ok=True)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cold, warm = timed(sys.executable, OURS, path, env), timed(sys.executable, OURS, path, env)
    peer = timed(args.llama_cpp_python, PEER, path, os.environ.copy()) if args.llama_cpp_python else None
    row = {"bench": "load", "model": Path(path).name, "size_mb": round(Path(path).stat().st_size / 2**20, 1),
           "cold_s": round(cold["load_s"], 3), "warm_s": round(warm["load_s"], 3),
           "import_s": round(warm["import_s"], 3), "llama_cpp_s": round(peer["load_s"], 3) if peer else None,
           "llama_cpp_import_s": round(peer["import_s"], 3) if peer else None}
    if peer:
        row["warm_vs_llama_cpp"] = round(warm["load_s"] / peer["load_s"], 2)
    print(json.dumps(row))


if __name__ == "__main__":
    main()
