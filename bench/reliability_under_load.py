"""Reliability under load: the soak of tests/reliability (concurrent streams, half hanging up at random,
two identical rounds), the first-chunk wait of n=2 requests against n=1 ones side by side, and the gaps
between healthy streams' tokens while an embeddings request of long inputs, two slow-compiling JSON schemas, or
a completion of 1,000 prompts runs beside them.

SmolLM2-135M on the CPU by default. Prints one JSON line: per round the requests sent, completed and
hung up, 5xx and in-band errors, KV blocks and requests still held afterwards, seconds; the server's
RSS after each round; the slowest / median time to first chunk of `--concurrency` n=1 and n=2
streams; and the p50 / p99 / max gap between tokens of `--gap-streams` streams alone and beside each of
those (`--gaps-only`: that alone). Run: python bench/reliability_under_load.py [--requests 200] [--tiny] [--quick]
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

from bench.gap_percentiles import percentiles  # noqa: E402
from tests.backend.server_process import ServerProcess  # noqa: E402
from tests.reliability.server_state import rss_bytes  # noqa: E402
from tests.reliability.soak import settle, soak_round  # noqa: E402


async def first_chunks(url: str, concurrency: int, n: int, max_tokens: int) -> list[float]:
    """Seconds from sending to the first content chunk, per stream."""

    async def one(i: int, client: httpx.AsyncClient) -> float:
        body = {
            "stream": True,
            "n": n,
            "max_tokens": max_tokens,
            "temperature": 0.8,
            "seed": i,
            "ignore_eos": True,
            "messages": [{"role": "user", "content": f"Describe folio {i} of the manuscript in detail."}],
        }
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


async def token_gaps(url: str, streams: int, max_tokens: int, burden=None) -> dict:
    """Gaps between the tokens of `streams` completion streams (logprobs=0: a chunk per step's token), over the
    time `burden(client)` (a request or several, sent once they have all started) runs beside them (None: the
    whole run, alone)."""
    times: list[list[float]] = [[] for _ in range(streams)]

    async def stream(i: int, client: httpx.AsyncClient) -> None:
        body = {
            "prompt": f"Folio {i} of the manuscript says",
            "max_tokens": max_tokens,
            "temperature": 0,
            "logprobs": 0,
            "ignore_eos": True,
            "stream": True,
        }
        async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
            async for line in response.aiter_lines():
                if line.startswith("data: {"):
                    times[i].append(time.monotonic())

    async with httpx.AsyncClient(timeout=1800, limits=httpx.Limits(max_connections=streams + 4)) as client:
        tasks = [asyncio.ensure_future(stream(i, client)) for i in range(streams)]
        window, seconds = (0.0, float("inf")), None
        if burden is not None:
            while not all(times):
                await asyncio.sleep(0.01)
            start = time.monotonic()
            await burden(client)
            window, seconds = (start, time.monotonic()), time.monotonic() - start
        await asyncio.gather(*tasks)
    gaps = [b - a for t in times for a, b in zip(t, t[1:]) if b > window[0] and a < window[1]]
    return {**percentiles(gaps), **({"burden_s": round(seconds, 2)} if seconds is not None else {})}


def _embeddings(url: str, inputs: list[list[int]]):
    async def send(client: httpx.AsyncClient) -> None:
        response = await client.post(f"{url}/v1/embeddings", json={"input": inputs})
        if response.status_code != 200:
            raise RuntimeError(f"embeddings: {response.status_code} {response.text}")

    return send


def _grammar_compiles(url: str, model: str):
    """Two chat requests whose JSON schemas (400 patterns each, their own) take seconds to compile."""

    async def send(client: httpx.AsyncClient) -> None:
        async def one(seed: int):
            schema = {
                "type": "object",
                "properties": {
                    f"p{k}": {
                        "type": "string",
                        "pattern": f"^([a-z]{{1,{seed + 8}}}-){{0,20}}[0-9]{{2,{k % 7 + 9}}}$",
                    }
                    for k in range(400)
                },
            }
            return await client.post(
                f"{url}/v1/chat/completions",
                json={
                    "model": model,
                    "messages": [{"role": "user", "content": "hi"}],
                    "max_tokens": 1,
                    "response_format": {
                        "type": "json_schema",
                        "json_schema": {"name": "x", "schema": schema},
                    },
                },
            )

        await asyncio.gather(one(int(time.time()) % 1000), one(int(time.time()) % 1000 + 1))

    return send


def _many_prompts(url: str, model: str):
    """A completion of 1,000 prompts: refused (--max-prompts) before any is tokenized."""

    async def send(client: httpx.AsyncClient) -> None:
        await client.post(
            f"{url}/v1/completions", json={"model": model, "prompt": ["hi"] * 1000, "max_tokens": 4}
        )

    return send


def gaps_beside_embeddings(url: str, args: argparse.Namespace) -> dict:
    card = httpx.get(f"{url}/v1/models").json()["data"][0]
    context, model = card["max_model_len"], card["id"]
    length, tokens = min(args.embed_tokens, context), min(args.gap_tokens, context - 16)
    # ids below 500: in every vocabulary, the tiny model's included
    inputs = [[3 + (i * 7 + j * 13) % 497 for j in range(length)] for i in range(args.embed_inputs)]
    return {
        "streams": args.gap_streams,
        "stream_tokens": tokens,
        "embedding_inputs": args.embed_inputs,
        "input_tokens": length,
        "alone": asyncio.run(token_gaps(url, args.gap_streams, tokens)),
        "beside_embeddings": asyncio.run(token_gaps(url, args.gap_streams, tokens, _embeddings(url, inputs))),
        "beside_grammar_compiles": asyncio.run(
            token_gaps(url, args.gap_streams, tokens, _grammar_compiles(url, model))
        ),
        "beside_1000_prompts": asyncio.run(
            token_gaps(url, args.gap_streams, tokens, _many_prompts(url, model))
        ),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--concurrency", type=int, default=24, help="streams in the n=1 / n=2 comparison")
    parser.add_argument("--tiny", action="store_true", help="a tiny random model instead of SmolLM2")
    parser.add_argument(
        "--gap-streams", type=int, default=16, help="healthy streams whose token gaps are measured"
    )
    parser.add_argument("--gap-tokens", type=int, default=256, help="tokens each of them generates")
    parser.add_argument(
        "--embed-inputs", type=int, default=8, help="inputs of the embeddings request beside them"
    )
    parser.add_argument("--embed-tokens", type=int, default=1500, help="tokens of each input")
    parser.add_argument("--gaps-only", action="store_true", help="only the token gaps beside embeddings")
    parser.add_argument(
        "--server-args",
        default="",
        help="more arguments for the server, e.g. '--long-prefill-token-threshold 2048' (the "
        "prompt chunks of a step while streams decode, as before the threshold)",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="a smoke run of a few minutes: 40 requests a round, 8 streams in the n=1 / n=2 "
        "comparison, 4 gap streams of 64 tokens, embedding inputs of 400 tokens",
    )
    args = parser.parse_args()
    if args.quick:
        vars(args).update(requests=40, concurrency=8, gap_streams=4, gap_tokens=64, embed_tokens=400)
    model = "smollm2"
    if args.tiny:
        from tests.backend.tiny_models import build_model

        model = str(build_model("llama", Path(tempfile.mkdtemp()) / "tiny"))
    server = ServerProcess(model, "--max-num-seqs", "64", *args.server_args.split())
    row: dict = {"bench": "reliability", "model": "tiny" if args.tiny else "smollm2-135m", "device": "cpu"}
    if args.gaps_only:
        row["server_args"] = args.server_args
    try:
        if not args.gaps_only:
            row.update(soak_and_first_chunks(server, args))
        row["token_gaps_s"] = gaps_beside_embeddings(server.url, args)
    finally:
        server.stop()
    print(json.dumps(row))


def soak_and_first_chunks(server: ServerProcess, args) -> dict:
    """Two identical soak rounds (what each left held, the server's RSS after each), then the first-chunk waits
    of n=1 and n=2 streams."""
    rounds, rss = [], []
    for seed in (1, 1):
        result = asyncio.run(soak_round(server.url, args.requests, args.max_tokens, seed))
        held = settle(server.url)
        rss.append(rss_bytes(server.proc.pid))
        rounds.append(
            {
                "requests": result.requests,
                "completed": result.completed,
                "hung_up": result.disconnected,
                "5xx": sum(v for k, v in result.statuses.items() if k >= 500),
                "errors": len(result.errors),
                "running_after": held["running"],
                "waiting_after": held["waiting"],
                "kv_usage_after": held["kv_cache_usage"],
                "seconds": round(result.seconds, 2),
            }
        )
    waits = {n: asyncio.run(first_chunks(server.url, args.concurrency, n, 32)) for n in (1, 2)}
    return {
        "rounds": rounds,
        "rss_mb_after_rounds": [round(r / 2**20, 1) for r in rss],
        "rss_growth": round(rss[1] / rss[0] - 1, 4),
        "first_chunk_s": {
            f"n{n}": {"max": round(max(w), 2), "median": round(statistics.median(w), 2)}
            for n, w in waits.items()
        },
        "n2_vs_n1_slowest_first_chunk": round(max(waits[2]) / max(waits[1]), 2),
    }


if __name__ == "__main__":
    main()
