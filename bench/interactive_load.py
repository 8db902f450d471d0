"""Interactive under load, on the CPU default (SmolLM2): a running stream's gaps between tokens (p50, p99, max) and
a new request's time to its first token, beside each burden alone: a long prompt, 8 embeddings inputs of ~1,500
tokens, a 128-prompt completion, and a CPU-bound process competing for the cores. Prints one JSON line.

The issue's targets on 2 quiet cores: max gap <= 1 s and a new request's first token <= 2 s beside each burden.

Run: python bench/interactive_load.py [--long-tokens 30000] [--max-model-len 32768]
"""

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import httpx  # noqa: E402

from tests.backend.server_process import ServerProcess, stream_gaps  # noqa: E402

SENTENCE = "The scribe copied the manuscript line by line, and the abbot read every page. "  # ~17 tokens


def first_token(url: str) -> float:
    start = time.monotonic()
    body = {"model": "smol", "prompt": f"{time.time()} Ink is", "max_tokens": 1}
    httpx.post(f"{url}/v1/completions", json=body, timeout=3600).raise_for_status()
    return time.monotonic() - start


def burdens(long_tokens: int) -> dict:
    def long_prompt(url: str) -> None:
        text = f"{time.time()} " + SENTENCE * (long_tokens // 17)
        httpx.post(f"{url}/v1/completions", json={"model": "smol", "prompt": text, "max_tokens": 1},
                   timeout=3600).raise_for_status()

    def embeddings(url: str) -> None:
        inputs = [f"{time.time()} {i} " + SENTENCE * 88 for i in range(8)]
        httpx.post(f"{url}/v1/embeddings", json={"model": "smol", "input": inputs}, timeout=3600).raise_for_status()

    def many_prompts(url: str) -> None:
        prompts = [f"{time.time()} {i} " + SENTENCE * 4 for i in range(128)]
        httpx.post(f"{url}/v1/completions", json={"model": "smol", "prompt": prompts, "max_tokens": 64,
                                                  "ignore_eos": True}, timeout=3600).raise_for_status()

    def competing_process(url: str) -> None:
        spin = "import time\nend = time.time() + 20\nwhile time.time() < end: pass"
        procs = [subprocess.Popen([sys.executable, "-c", spin]) for _ in range(os.cpu_count() or 2)]
        for p in procs:
            p.wait()

    return {"long_prompt": long_prompt, "embeddings": embeddings, "completion_128_prompts": many_prompts,
            "competing_process": competing_process}


def beside(url: str, burden) -> dict:
    gaps: list[float] = []
    started, stop = threading.Event(), threading.Event()
    reader = threading.Thread(target=stream_gaps, args=(url, "smol", 4000, started, gaps, stop))
    reader.start()
    started.wait(600)
    time.sleep(2)
    quiet = len(gaps)
    load = threading.Thread(target=burden, args=(url,))
    load.start()
    time.sleep(1.5)  # under way
    ttft = first_token(url)
    load.join()
    stop.set()
    reader.join()
    during = sorted(gaps[quiet:]) or [0.0]
    return {"gap_p50_s": round(during[len(during) // 2], 3), "gap_p99_s": round(during[int(len(during) * 0.99)], 3),
            "gap_max_s": round(during[-1], 3), "new_request_ttft_s": round(ttft, 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--long-tokens", type=int, default=30000)
    parser.add_argument("--max-model-len", type=int, default=32768)
    parser.add_argument("--only", action="append", help="run only these burdens")
    args = parser.parse_args()
    server = ServerProcess("smollm2", "--served-model-name", "smol", "--max-model-len", str(args.max_model_len),
                           "--disk-cache-bytes", "0")
    row = {"bench": "interactive_load", "model": "smollm2", "device": "cpu", "threads": os.cpu_count(),
           "long_tokens": args.long_tokens}
    try:
        for name, burden in burdens(args.long_tokens).items():
            if not args.only or name in args.only:
                row[name] = beside(server.url, burden)
    finally:
        server.stop()
    print(json.dumps(row))


if __name__ == "__main__":
    main()
