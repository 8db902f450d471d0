"""A loglikelihood workload as lm-evaluation-harness sends it: multiple-choice requests (a ~90-token context and
one of four ~10-token continuations each) as `{"prompt": [[ids]], "max_tokens": 1, "logprobs": 1, "echo": true,
"temperature": 0}`, through the server, against transformers on the same GGUF (dequantized, fp32) side by side.

Prints one JSON line: requests per second each way, the largest |difference| of a prompt token's logprob, the
largest difference of a continuation's total, and how often the two pick the same choice. The texts are windows
of this project's README in SmolLM2's tokens (the right continuation and three from elsewhere).
Run: python bench/eval.py [--questions 50] [--concurrency 8]
"""

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402
import torch  # noqa: E402

from backend.model_store import pull  # noqa: E402
from tests.backend.hf_gguf import transformers_tokenizer_and_model  # noqa: E402
from tests.backend.server_process import ServerProcess  # noqa: E402

CONTEXT, CONTINUATION, CHOICES = 90, 10, 4


def questions(tokens: list[int], count: int) -> list[tuple[list[int], list[list[int]], int]]:
    """(context, four continuations, which is right): windows of the text, distractors from far away."""
    out, span = [], CONTEXT + CONTINUATION
    step = (len(tokens) - span) // count
    for q in range(count):
        start = q * step
        context, right = tokens[start:start + CONTEXT], tokens[start + CONTEXT:start + span]
        others = [tokens[(start + (k + 1) * len(tokens) // CHOICES) % (len(tokens) - span):][CONTEXT:span]
                  for k in range(CHOICES - 1)]
        answer = q % CHOICES
        options = others[:answer] + [right] + others[answer:]
        out.append((context, options, answer))
    return out


async def served(url: str, requests: list[list[int]], concurrency: int) -> tuple[list[list[float]], float]:
    """Every request's prompt token logprobs (the first, null, left out), and the seconds they took."""
    gate = asyncio.Semaphore(concurrency)

    async def one(client: httpx.AsyncClient, ids: list[int]) -> list[float]:
        async with gate:
            r = await client.post(f"{url}/v1/completions", json={"prompt": [ids], "max_tokens": 1, "logprobs": 1,
                                                                  "echo": True, "temperature": 0})
            r.raise_for_status()
            return r.json()["choices"][0]["logprobs"]["token_logprobs"][1:len(ids)]

    start = time.perf_counter()
    async with httpx.AsyncClient(timeout=600) as client:
        answers = await asyncio.gather(*(one(client, ids) for ids in requests))
    return list(answers), time.perf_counter() - start


def reference(model, requests: list[list[int]]) -> tuple[list[list[float]], float]:
    start = time.perf_counter()
    out = []
    with torch.no_grad():
        for ids in requests:
            logprobs = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
            out.append(logprobs[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0].tolist())
    return out, time.perf_counter() - start


def picks(items, logprobs: list[list[float]]) -> list[int]:
    """The choice each question's continuation totals prefer, as a loglikelihood task scores it."""
    out, k = [], 0
    for context, options, _ in items:
        totals = [sum(logprobs[k + i][len(context) - 1:]) for i in range(len(options))]
        out.append(max(range(len(options)), key=totals.__getitem__))
        k += len(options)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--questions", type=int, default=50, help="four requests each")
    parser.add_argument("--concurrency", type=int, default=8, help="requests in flight to the server")
    args = parser.parse_args()
    path = pull("smollm2", quiet=True)
    tokenizer, model = transformers_tokenizer_and_model(path)
    items = questions(tokenizer((ROOT / "README.md").read_text()).input_ids, args.questions)
    requests = [context + option for context, options, _ in items for option in options]

    # at its trained context: smollm2's default 32k context scales RoPE (YaRN x4), which moves every logprob
    ours_server = ServerProcess("smollm2", "--max-num-seqs", "64", "--max-model-len", "8192")
    try:
        asyncio.run(served(ours_server.url, requests[:4], args.concurrency))  # warm
        ours, ours_s = asyncio.run(served(ours_server.url, requests, args.concurrency))
    finally:
        ours_server.stop()
    theirs, theirs_s = reference(model, requests)

    deltas = [abs(a - b) for x, y in zip(ours, theirs) for a, b in zip(x, y)]
    total_deltas = [abs(sum(x[len(c) - 1:]) - sum(y[len(c) - 1:]))
                    for (c, options, _), k in zip(items, range(0, len(requests), CHOICES))
                    for x, y in zip(ours[k:k + len(options)], theirs[k:k + len(options)])]
    ours_picks, theirs_picks = picks(items, ours), picks(items, theirs)
    right = [answer for _, _, answer in items]
    print(json.dumps({
        "bench": "eval", "model": "smollm2-135m Q4_1", "device": "cpu", "requests": len(requests),
        "tokens_per_request": CONTEXT + CONTINUATION, "concurrency": args.concurrency,
        "ours_requests_per_s": round(len(requests) / ours_s, 2),
        "transformers_requests_per_s": round(len(requests) / theirs_s, 2),
        "speedup": round(theirs_s / ours_s, 2),
        "max_abs_delta_logprob": float(f"{max(deltas):.3g}"),
        "mean_abs_delta_logprob": float(f"{sum(deltas) / len(deltas):.3g}"),
        "max_abs_delta_continuation": float(f"{max(total_deltas):.3g}"),
        "same_choice": round(sum(a == b for a, b in zip(ours_picks, theirs_picks)) / len(items), 3),
        "accuracy_ours": round(sum(a == b for a, b in zip(ours_picks, right)) / len(items), 3),
        "accuracy_transformers": round(sum(a == b for a, b in zip(theirs_picks, right)) / len(items), 3),
    }))


if __name__ == "__main__":
    main()
