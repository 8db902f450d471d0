"""Server overhead: 64 concurrent streamed chat requests through the openai client vs the offline engine.

SmolLM2-135M on the CPU, greedy, fixed length (ignore_eos). Prints one JSON line with the
server's aggregate tokens/s, p50/p99 time to first token and inter-token latency, and the
ratio to the offline engine's aggregate on the same prompts. Run: python bench/server_overhead.py

With --tools, the tool-calling row instead: the same requests with `tools` and
tool_choice="required" (grammar-constrained) against the same requests without tools, both
non-streamed: tokens/s of each, and the share of calls whose arguments validate (target 1.0). A
call cut off by max_tokens cannot validate: keep --max-tokens at 64 or more (a call is ~40 tokens);
truncated_calls counts them. Run: python bench/server_overhead.py --tools
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


WEATHER_SCHEMA = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 32}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"]}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The current weather in a city",
                                            "parameters": WEATHER_SCHEMA}}


async def run_tools(url: str, convs: list[list[dict]], max_tokens: int, tools: bool
                    ) -> tuple[float, int, int, int]:
    """(seconds, completion tokens, calls whose arguments validate, answers cut off by max_tokens) of the
    requests, sent all at once."""
    import jsonschema
    import openai

    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=900)
    extra = dict(tools=[WEATHER], tool_choice="required", parallel_tool_calls=False) if tools else {}

    async def one(messages) -> tuple[int, int, int]:
        out = await client.chat.completions.create(model="smollm2", messages=messages, max_tokens=max_tokens,
                                                   temperature=0, **extra)
        valid = 0
        for call in out.choices[0].message.tool_calls or []:  # one at most: parallel_tool_calls=False
            try:
                jsonschema.validate(json.loads(call.function.arguments), WEATHER_SCHEMA)
                valid += 1
            except (ValueError, jsonschema.ValidationError):
                pass
        return out.usage.completion_tokens, valid, int(out.choices[0].finish_reason == "length")

    async with client:
        start = time.perf_counter()
        results = await asyncio.gather(*(one(m) for m in convs))
        elapsed = time.perf_counter() - start
    return elapsed, sum(r[0] for r in results), sum(r[1] for r in results), sum(r[2] for r in results)


def tools_row(args) -> dict:
    cities = ["Paris", "Lyon", "Bruges", "Kraków", "Toledo", "York", "Bologna", "Uppsala"]
    asks = [[{"role": "user", "content": f"What is the weather in {cities[i % len(cities)]} today, reader {i}?"}]
            for i in range(args.concurrency)]
    server = ServerProcess("smollm2", "--max-num-seqs", str(args.concurrency))
    try:
        asyncio.run(run_tools(server.url, asks[:2], 8, True))  # warm-up, the grammar compiled
        plain_s, plain_tokens, _, _ = asyncio.run(run_tools(server.url, asks, args.max_tokens, False))
        tools_s, tools_tokens, valid, cut = asyncio.run(run_tools(server.url, asks, args.max_tokens, True))
    finally:
        server.stop()
    tools_tok_s, plain_tok_s = tools_tokens / tools_s, plain_tokens / plain_s
    return {"bench": "server_tools", "model": "smollm2-135m", "device": "cpu", "concurrency": args.concurrency,
            "max_tokens": args.max_tokens, "tools_tok_s": round(tools_tok_s, 2),
            "plain_tok_s": round(plain_tok_s, 2), "ratio": round(tools_tok_s / plain_tok_s, 3),
            "valid_calls": round(valid / len(asks), 3), "truncated_calls": cut}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--tools", action="store_true", help="the tool-calling row (see the docstring)")
    args = parser.parse_args()
    pull("smollm2", quiet=True)
    if args.tools:
        print(json.dumps(tools_row(args)))
        return
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
