"""A prompt chunk's attention on the CPU over a long cached prefix: torch's (the gather and SDPA), our C decode-rows
kernel (each row alone) and our C chunk kernel (csrc/cpu_chunk_attention.c), one layer at SmolLM2's shape (9 query
heads, 3 kv heads, head dim 64, fp32 cache, block 16), ms a layer; then SmolLM2's prompt of --prompt tokens
computed in --chunk-token chunks with the chunk kernel and without (torch's), seconds to its first token (the
prefix cache off). One JSON line; the layer figures on stderr as they come.

    python bench/chunk_attention.py [--context 30000] [--prompt 8192] [--chunk 256] [--threads N] [--quick]
"""

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from backend.kernels import attention  # noqa: E402
from backend.kernels.step_paths import TORCH, chunk_kernel  # noqa: E402

HQ, HKV, D, BS = 9, 3, 64, 16


def best_ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times) * 1000


def layer_times(context: int, rows: int, repeats: int) -> dict:
    """ms of one layer's attention for a chunk of `rows` ending at `context`, by each kernel."""
    g = torch.Generator().manual_seed(0)
    blocks = (context + BS - 1) // BS + 8
    k_cache, v_cache = (
        torch.randn(blocks, BS, HKV, D, generator=g),
        torch.randn(blocks, BS, HKV, D, generator=g),
    )
    table = torch.randperm(blocks, generator=g)[: (context + BS - 1) // BS]
    q = torch.randn(rows, HQ, D, generator=g)
    lens = torch.arange(context - rows + 1, context + 1)
    times = {
        "torch": best_ms(
            lambda: attention.prefill_attention(q, k_cache, v_cache, table, context, 0.125, kernel=TORCH),
            repeats,
        ),
        "c_chunk": best_ms(
            lambda: attention.prefill_attention(q, k_cache, v_cache, table, context, 0.125), repeats
        ),
    }
    if rows <= 128:  # each row reads the whole cache: seconds past that
        times["c_rows"] = best_ms(
            lambda: attention._native_rows(q, k_cache, v_cache, table.expand(rows, -1), lens, 0.125, None),
            repeats,
        )
    return {k: round(v, 2) for k, v in times.items()}


def prompt_seconds(length: int, chunk: int, with_kernel: bool) -> float:
    """SmolLM2's prompt of `length` tokens in chunks of `chunk`, no prefix cache: seconds to its first token."""
    from backend import LLM, SamplingParams
    from backend.model_store import pull

    llm = LLM(
        str(pull("smollm2", quiet=True)),
        max_model_len=length + 64,
        max_num_batched_tokens=chunk,
        enable_prefix_caching=False,
    )
    prompt = [(17 * i + 3) % 40000 + 3 for i in range(length)]
    kernel = attention.chunk_kernel
    if not with_kernel:  # the torch path for every chunk, as before the kernel
        attention.chunk_kernel = lambda *args, **kwargs: TORCH
    try:
        start = time.perf_counter()
        llm.generate(prompt, SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
        return round(time.perf_counter() - start, 2)
    finally:
        attention.chunk_kernel = kernel


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--context", type=int, default=30000)
    parser.add_argument("--prompt", type=int, default=8192)
    parser.add_argument("--chunk", type=int, default=256)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--quick", action="store_true", help="the layer figures only")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    assert (
        chunk_kernel(torch.zeros(8, HQ, D), torch.zeros(1, BS, HKV, D), torch.zeros(1, BS, HKV, D)) != TORCH
    )
    result = {"threads": torch.get_num_threads(), "context": args.context, "layer_ms": {}}
    for rows in (8, 32, 128, 512):
        result["layer_ms"][f"S{rows}"] = layer_times(args.context, rows, 3)
        print(rows, result["layer_ms"][f"S{rows}"], file=sys.stderr, flush=True)
    for rows in (128, 512, 2048):  # a fresh prompt: SDPA is_causal, nothing gathered
        result["layer_ms"][f"fresh_{rows}"] = layer_times(rows, rows, 5)
    print(result["layer_ms"], file=sys.stderr, flush=True)
    if not args.quick:
        result["prompt"] = {
            "tokens": args.prompt,
            "chunk": args.chunk,
            "torch_s": prompt_seconds(args.prompt, args.chunk, False),
            "c_chunk_s": prompt_seconds(args.prompt, args.chunk, True),
        }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
