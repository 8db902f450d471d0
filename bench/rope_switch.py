"""SmolLM2 (trained at 8192 tokens) served at 32768 with YaRN x4, as `serve` runs it: short texts' next-token
loss against the unscaled model (max_model_len 8192) and against static YaRN at every length (the switch off, as
before engine/rope_switch.py), and a text past 8192 tokens scaled. One JSON line on stdout.

    python bench/rope_switch.py [--texts 2] [--tokens 1500] [--long 0]

On 2 shared cores (2026-12-06, 399 s): 2 texts of 1,500 tokens, mean loss 2.1252 nats served at 32,768 and at
8192 (largest difference a token 2.4e-5), 2.2241 with static YaRN (perplexity 8.375 -> 9.245).
"""

import argparse
import json
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from backend import LLM, SamplingParams  # noqa: E402
from backend.loader import load_tokenizer, locate  # noqa: E402
from bench.long_context import stdlib_text  # noqa: E402


def losses(length: int, texts: list[list[int]], switch: bool = True) -> list[torch.Tensor]:
    """-log p(token i+1 | tokens <= i) of every text's tokens after its first, from its prompt logprobs."""
    llm = LLM(
        "smollm2",
        max_model_len=length,
        max_num_seqs=1,
        num_kv_blocks=length // 16 + 1,
        enable_prefix_caching=False,
    )
    if not switch:
        llm.engine.scheduler.rope_switch = None  # every sequence reads the scaled rows
    outs = llm.generate(texts, SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    return [
        torch.tensor([-entry[token].logprob for entry, token in zip(out.prompt_logprobs[1:], ids[1:])])
        for out, ids in zip(outs, texts)
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--texts", type=int, default=2, help="short texts")
    parser.add_argument("--tokens", type=int, default=1500, help="tokens of each short text")
    parser.add_argument(
        "--long",
        type=int,
        default=0,
        help="tokens of a text past the trained length (0: none; 10,000 take over 20 min on 2 cores)",
    )
    args = parser.parse_args()
    started = time.perf_counter()
    ids = load_tokenizer(locate("smollm2"))(stdlib_text(6 * args.tokens * args.texts))["input_ids"]
    short = [ids[i * args.tokens : (i + 1) * args.tokens] for i in range(args.texts)]
    unscaled, served, static = losses(8192, short), losses(32768, short), losses(32768, short, switch=False)

    def mean(rows: list[torch.Tensor]) -> float:
        return round(torch.cat(rows).mean().item(), 5)

    row = {
        "model": "smollm2 (SmolLM2-135M-Instruct Q4_1, trained at 8192)",
        "text": "Python stdlib sources",
        "short_texts": args.texts,
        "tokens_each": args.tokens,
        "mean_loss_nats": {
            "unscaled_8192": mean(unscaled),
            "served_32768": mean(served),
            "static_yarn_32768": mean(static),
        },
        "perplexity": {
            "unscaled_8192": round(math.exp(mean(unscaled)), 3),
            "served_32768": round(math.exp(mean(served)), 3),
            "static_yarn_32768": round(math.exp(mean(static)), 3),
        },
        "max_abs_loss_diff_served_vs_unscaled": max(
            (a - b).abs().max().item() for a, b in zip(served, unscaled)
        ),
        "max_abs_loss_diff_static_vs_unscaled": max(
            (a - b).abs().max().item() for a, b in zip(static, unscaled)
        ),
    }
    if args.long:
        text = load_tokenizer(locate("smollm2"))(stdlib_text(6 * args.long))["input_ids"][: args.long]
        [past], [past_static] = losses(32768, [text]), losses(32768, [text], switch=False)
        row["past_trained_length"] = {
            "tokens": args.long,
            "served_equals_static_yarn": bool(torch.equal(past, past_static)),
            "mean_loss_nats": round(past.mean().item(), 5),
        }
    row["seconds"] = round(time.perf_counter() - started)
    print(json.dumps(row))


if __name__ == "__main__":
    main()
