"""Model swaps in one multi-model server: two GGUF models behind `serve --max-loaded-models 1`, asked in turn, so
every request unloads one model and loads the other (weights mapped from the pack cache, tokenizer, KV cache).
Prints the time of a one-token request that swaps, beside one that does not, in one JSON line.

Run: python bench/swap.py [--turns 6]   (SmolLM2 and bench/moe_gguf.py's Qwen3-MoE-shaped file)
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from moe_gguf import moe_file  # noqa: E402

from backend.model_store import pull  # noqa: E402


def ask(client: httpx.Client, model: str) -> float:
    start = time.perf_counter()
    response = client.post("/v1/completions", json={"model": model, "prompt": [5, 6, 7], "max_tokens": 1},
                           timeout=300)
    response.raise_for_status()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--port", type=int, default=8137)
    args = parser.parse_args()
    models = {"small": pull("smollm2", quiet=True), "moe": moe_file("qwen3_moe")}
    command = [sys.executable, "-m", "backend", "serve", "--port", str(args.port), "--max-loaded-models", "1",
               *[a for name, path in models.items() for a in ("--model", f"{name}={path}")]]
    server = subprocess.Popen(command, cwd=ROOT, env=os.environ, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{args.port}") as client:
            for _ in range(600):
                try:
                    if client.get("/health").status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                time.sleep(0.5)
            ask(client, "small"), ask(client, "moe"), ask(client, "small")  # both packed and cached once
            swaps = [ask(client, name) for _ in range(args.turns) for name in ("moe", "small")]
            same = [ask(client, "small") for _ in range(args.turns)]
    finally:
        server.terminate()
        server.wait(60)
    print(json.dumps({"bench": "swap", "models": {k: Path(v).name for k, v in models.items()},
                      "swap_request_s": {"p50": round(statistics.median(swaps), 3), "max": round(max(swaps), 3)},
                      "loaded_request_s": {"p50": round(statistics.median(same), 3)}}))


if __name__ == "__main__":
    main()
