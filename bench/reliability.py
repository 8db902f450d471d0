"""Reliability under load: the soak of tests/reliability (concurrent streams, half hanging up at random,
two identical rounds) and the first-chunk wait of n=2 requests against n=1 ones side by side.

SmolLM2-135M on the CPU by default. Prints one JSON line: per round the requests sent, completed and
hung up, 5xx and in-band errors, KV blocks and requests still held afterwards, seconds; the server's
RSS after each round; and the slowest / median time to first chunk of `--concurrency` n=1 and n=2
streams. Run: python bench/reliability.py [--requests 200] [--tiny]
"""

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import httpx  # noqa: E402

from tests.backend.server_process import ServerProcess  # noqa: E402
from tests.reliability.server_state import rss_bytes  # noqa: E402
from tests.reliability.soak import settle, soak_round  # noqa: E402


async def first_chunks(url: str, concurrency: int, n: int, max_tokens: int) -> list[float]:
    """Seconds from sending to the first content chunk, per stream."""
    async def one(i: int, client: httpx.AsyncClient) -> float:
        body = {"stream": True, "n": n, "max_tokens": max_tokens, "temperature": 0.8, "seed": i, "ignore_eos": True,
                "messages": [{"role": "user", "content": f"Describe folio {i} of the manuscript in detail."}]}
        start = time.monotonic()
        async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                choices = json.loads(line[6:]).get("choices") or [{}]
                if choices[0].get("delta", {}).get("content"):
                    return time.monotonic() - start
        return time.monotonic() - start

    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=concurrency)) as client:
        return list(await asyncio.gather(*(one(i, client) for i in range(concurrency))))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--concurrency", type=int, default=24, help="streams in the n=1 / n=2 comparison")
    parser.add_argument("--tiny", action="store_true", help="a tiny random model instead of SmolLM2")
    args = parser.parse_args()
    model = "smollm2"
    if args.tiny:
        from tests.backend.tiny_models import build_model

        model = str(build_model("llama", Path(tempfile.mkdtemp()) / "tiny"))
    server = ServerProcess(model, "--max-num-seqs", "64")
    try:
        rounds, rss = [], []
        for seed in (1, 1):
            result = asyncio.run(soak_round(server.url, args.requests, args.max_tokens, seed))
            held = settle(server.url)
            rss.append(rss_bytes(server.proc.pid))
            rounds.append({"requests": result.requests, "completed": result.completed,
                           "hung_up": result.disconnected, "5xx": sum(v for k, v in result.statuses.items() if k >= 500),
                           "errors": len(result.errors), "running_after": held["running"],
                           "waiting_after": held["waiting"], "kv_usage_after": held["kv_cache_usage"],
                           "seconds": round(result.seconds, 2)})
        waits = {n: asyncio.run(first_chunks(server.url, args.concurrency, n, 32)) for n in (1, 2)}
    finally:
        server.stop()
    print(json.dumps({
        "bench": "reliability", "model": "tiny" if args.tiny else "smollm2-135m", "device": "cpu", "rounds": rounds,
        "rss_mb_after_rounds": [round(r / 2**20, 1) for r in rss],
        "rss_growth": round(rss[1] / rss[0] - 1, 4),
        "first_chunk_s": {f"n{n}": {"max": round(max(w), 2), "median": round(statistics.median(w), 2)}
                          for n, w in waits.items()},
        "n2_vs_n1_slowest_first_chunk": round(max(waits[2]) / max(waits[1]), 2),
    }))


if __name__ == "__main__":
    main()
