"""Server overhead: 64 concurrent streamed chat requests through the openai client vs the offline engine.

SmolLM2-135M on the CPU, greedy, fixed length (ignore_eos). Prints one JSON line with the
server's aggregate tokens/s, p50/p99 time to first token and inter-token latency, and the
ratio to the offline engine's aggregate on the same prompts. Run: python bench/server.py
"""

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from backend import LLM, SamplingParams  # noqa: E402
from backend.model_store import pull  # noqa: E402
from tests.backend.server_process import ServerProcess  # noqa: E402

TOPICS = ["ink", "vellum", "quills", "candles", "bindings", "margins", "psalters", "scriptoria"]


def conversations(n: int) -> list[list[dict]]:
    return [[{"role": "user", "content": f"Tell me about medieval {TOPICS[i % len(TOPICS)]}, part {i}."}]
            for i in range(n)]


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


async def run_server(url: str, convs: list[list[dict]], max_tokens: int) -> tuple[float, int, list, list]:
    import openai

    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=600)
    ttfts, gaps = [], []

    async def one(messages) -> int:
        start = time.perf_counter()
        last = None
        chunks = 0
        stream = await client.chat.completions.create(
            model="smollm2", messages=messages, max_tokens=max_tokens, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        tokens = 0
        async for chunk in stream:
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
            if chunk.choices and chunk.choices[0].delta.content:
                now = time.perf_counter()
                if last is None:
                    ttfts.append(now - start)
                else:
                    gaps.append(now - last)
                last = now
                chunks += 1
        return tokens

    async with client:
        start = time.perf_counter()
        counts = await asyncio.gather(*(one(m) for m in convs))
        elapsed = time.perf_counter() - start
    return elapsed, sum(counts), ttfts, gaps


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()
    pull("smollm2", quiet=True)
    convs = conversations(args.concurrency)

    server = ServerProcess("smollm2", "--max-num-seqs", str(args.concurrency))
    try:
        asyncio.run(run_server(server.url, convs[:2], 4))  # warm-up
        elapsed, tokens, ttfts, gaps = asyncio.run(run_server(server.url, convs, args.max_tokens))
    finally:
        server.stop()
    server_tok_s = tokens / elapsed

    llm = LLM("smollm2", max_num_seqs=args.concurrency)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    llm.chat(convs[:2], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)  # warm-up
    start = time.perf_counter()
    outs = llm.chat(convs, params, use_tqdm=False)
    offline_elapsed = time.perf_counter() - start
    offline_tok_s = sum(len(o.outputs[0].token_ids) for o in outs) / offline_elapsed

    print(json.dumps({
        "bench": "server", "model": "smollm2-135m", "device": "cpu", "concurrency": args.concurrency,
        "max_tokens": args.max_tokens, "server_tok_s": round(server_tok_s, 2), "offline_tok_s": round(offline_tok_s, 2),
        "ratio": round(server_tok_s / offline_tok_s, 3),
        "ttft_p50_s": round(statistics.median(ttfts), 3), "ttft_p99_s": round(percentile(ttfts, 0.99), 3),
        "itl_p50_s": round(statistics.median(gaps), 4), "itl_p99_s": round(percentile(gaps, 0.99), 4),
    }))


if __name__ == "__main__":
    main()
