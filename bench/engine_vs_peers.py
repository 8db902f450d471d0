"""Engine vs transformers' generate on the same weights (SmolLM2-135M, fp32, CPU), greedy.

Prints one JSON line: single-request decode speed, 32-request aggregate throughput, time to first
token with a 1,000-token cached prefix vs cold, and decoding after a 2,000-token prompt (long_*, and with
kv_cache_dtype float16: long_kv_f16_*); then with 8-bit activations (int8_*: activations="int8", llama.cpp's
arithmetic) beside transformers fp32, and the same in bfloat16 (bf16_*: bf16 products on AMX where the CPU has it)
beside transformers in bfloat16.

--quantized: the quantized-weights rows instead (quantized_rows): SmolLM2's Q4_1 file and a Q8_0 conversion,
our quantized path (fp32 and int8 activations) vs our fp32 path vs transformers fp32, and llama.cpp given
--llama-cpp-python (its own venv).
"""

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from backend import LLM, SamplingParams  # noqa: E402
from backend.model_store import pull  # noqa: E402

WORDS = ["scribe", "ink", "quill", "vellum", "monastery", "candle", "letter", "margin", "gloss", "chapter", "psalm", "binding", "copyist", "apprentice", "master", "page", "line", "illumination", "gold", "script"]


def make_prompt(tokenizer, n_tokens: int, salt: int) -> list[int]:
    words = [WORDS[(i * 7 + salt * 3 + i // 5) % len(WORDS)] for i in range(n_tokens * 2)]
    return tokenizer(" ".join(words)).input_ids[:n_tokens]


def hf_generate(model, prompts: list[list[int]], new_tokens: int, pad_id: int) -> float:
    """Seconds for transformers to generate new_tokens for all prompts as one left-padded batch."""
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                             do_sample=False, pad_token_id=pad_id)
    elapsed = time.perf_counter() - start
    assert out.shape[1] == width + new_tokens
    return elapsed


REPEATS = 2  # each timing is the best of this many runs, for every engine alike: this VM's speed varies by 20%


def best(run, *args) -> float:
    return min(run(*args) for _ in range(REPEATS))


def ours_generate(llm: LLM, prompts: list[list[int]], new_tokens: int) -> float:
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    assert all(len(o.outputs[0].token_ids) == new_tokens for o in outs)
    return elapsed


def ours_decode_rate(llm: LLM, prompt: list[int], new_tokens: int) -> float:
    """Decode tokens/s of one request after its prompt (the prompt's time, a max_tokens=1 run's, taken out)."""
    return new_tokens / (best(ours_generate, llm, [prompt], new_tokens + 1) - best(ours_generate, llm, [prompt], 1))


def decode_split(llm: LLM, prompt: list[int], step_ms: float, steps: int = 32) -> dict:
    """One batch-1 decode step split into matmul time (the profiler's self time of every *mm* op, fp32 ones, plus
    the wall time of our quantized CPU kernel, which the profiler does not see: its calls from Python and those
    inside the one-call decode step; per decode step, the prompt's taken out) and everything else (the
    unprofiled step time minus that)."""
    import ctypes

    from torch.profiler import ProfilerActivity, profile

    from backend.kernels import native
    from backend.quant import cpu_layout

    kernel = cpu_layout.matmul
    kernel_s = [0.0]

    def timed(*args):
        start = time.perf_counter()
        out = kernel(*args)
        kernel_s[0] += time.perf_counter() - start
        return out

    inside = ctypes.c_double.in_dll(native.library(), "matmul_seconds") if native.enabled() else ctypes.c_double()

    def matmul_ms(max_tokens: int) -> float:
        """Of one request: its prompt's and then max_tokens - 1 decode steps'."""
        kernel_s[0], before = 0.0, inside.value
        cpu_layout.matmul = timed
        try:
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                llm.generate([prompt], SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
                             use_tqdm=False)
        finally:
            cpu_layout.matmul = kernel
        profiled_us = sum(e.self_cpu_time_total for e in prof.key_averages()
                          if e.key.startswith("aten::") and "mm" in e.key.split("::", 1)[1])
        return profiled_us / 1000 + (kernel_s[0] + inside.value - before) * 1000

    matmul_ms(1)  # the prompt in the prefix cache for both runs below (a long prompt before may have evicted it)
    per_step = (matmul_ms(steps + 1) - matmul_ms(1)) / steps  # the prompt's matmuls taken out
    return {"step_ms": round(step_ms, 2), "matmul_ms": round(per_step, 2), "other_ms": round(step_ms - per_step, 2)}


def time_to_first_token(llm: LLM, prompt: list[int]) -> float:
    start = time.perf_counter()
    llm.generate(prompt, SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--prefix", type=int, default=1000)
    parser.add_argument("--long-context", type=int, default=2000, help="prompt tokens of the long_* row")
    parser.add_argument("--llama-cpp-python", default=os.environ.get("LLAMA_CPP_PYTHON"),
                        help="the python of a venv with llama-cpp-python: adds llama.cpp's rows (--quantized)")
    parser.add_argument("--quantized", action="store_true", help="only the quantized-weights rows (quantized_rows)")
    parser.add_argument("--moe", action="store_true", help="only the MoE rows vs llama.cpp (engine_quantized.moe_rows)")
    parser.add_argument("--shapes", default=None, help="with --moe: bench/moe_gguf.py's SHAPES, comma-separated")
    parser.add_argument("--rounds", type=int, default=3, help="with --moe: ours and llama.cpp in turn, medians")
    args = parser.parse_args()
    if args.quantized or args.moe:
        from engine_quantized import moe_rows, quantized_rows  # bench/, beside this script

        for row in moe_rows(args) if args.moe else [quantized_rows(args)]:
            print(json.dumps(row), flush=True)
        return

    from transformers import AutoModelForCausalLM

    path = pull("smollm2", quiet=True)
    llm = LLM("smollm2", dtype="float32", max_num_seqs=max(64, args.concurrency))
    tokenizer = llm.tokenizer
    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0

    single = [make_prompt(tokenizer, 32, 0)]
    ours_generate(llm, single, 8)  # warm-up both
    hf_generate(hf, single, 8, pad)
    ours_single = args.new_tokens / best(ours_generate, llm, single, args.new_tokens)
    hf_single = args.new_tokens / best(hf_generate, hf, single, args.new_tokens, pad)

    batch = [make_prompt(tokenizer, 32, salt) for salt in range(1, args.concurrency + 1)]
    total = args.new_tokens * args.concurrency
    ours_batch = total / best(ours_generate, llm, batch, args.new_tokens)
    hf_batch = total / best(hf_generate, hf, batch, args.new_tokens, pad)

    prefix = make_prompt(tokenizer, args.prefix, 99)
    cold_llm = LLM("smollm2", dtype="float32", enable_prefix_caching=False)
    time_to_first_token(cold_llm, prefix[:50])  # warm-up
    cold = min(time_to_first_token(cold_llm, prefix + make_prompt(tokenizer, 24, s)) for s in (1, 2))
    time_to_first_token(llm, prefix + make_prompt(tokenizer, 24, 0))  # fills the cache
    cached = min(time_to_first_token(llm, prefix + make_prompt(tokenizer, 24, s)) for s in (1, 2))

    long_prompt = make_prompt(tokenizer, args.long_context, 77)
    ours_long = ours_decode_rate(llm, long_prompt, 64)
    hf_long = 64 / (best(hf_generate, hf, [long_prompt], 65, pad) - best(hf_generate, hf, [long_prompt], 1, pad))
    half_cache = LLM("smollm2", dtype="float32", kv_cache_dtype="float16")
    ours_long_f16 = ours_decode_rate(half_cache, long_prompt, 64)
    del half_cache
    int8 = int8_rows(args, single, batch, hf_single, hf_batch)
    bf16 = bf16_rows(args, llm, single, batch, prefix, hf, pad)
    print(json.dumps({
        "bench": "engine", "model": "smollm2-135m", "dtype": "float32", "device": "cpu",
        "threads": torch.get_num_threads(), "new_tokens": args.new_tokens,
        "single_tok_s": round(ours_single, 2), "single_tok_s_transformers": round(hf_single, 2),
        "single_ratio": round(ours_single / hf_single, 2),
        "batch": args.concurrency, "batch_tok_s": round(ours_batch, 2),
        "batch_tok_s_transformers": round(hf_batch, 2), "batch_ratio": round(ours_batch / hf_batch, 2),
        "prefix_tokens": args.prefix, "ttft_cold_s": round(cold, 4), "ttft_cached_s": round(cached, 4),
        "ttft_speedup": round(cold / cached, 2),
        "decode_step_split": decode_split(llm, single[0], 1000 / ours_single),
        "long_context": args.long_context, "long_tok_s": round(ours_long, 2),
        "long_tok_s_transformers": round(hf_long, 2), "long_ratio": round(ours_long / hf_long, 2),
        "long_kv_f16_tok_s": round(ours_long_f16, 2), "long_kv_f16_vs_fp32_cache": round(ours_long_f16 / ours_long, 2),
        **int8, **bf16,
    }))


def int8_rows(args, single, batch, hf_single: float, hf_batch: float) -> dict:
    """activations="int8" (x quantized per group to 8 bits, integer products), the same prompts, beside transformers
    fp32 (already timed), and its step's split."""
    llm = LLM("smollm2", activations="int8", max_num_seqs=max(64, args.concurrency))
    ours_generate(llm, single, 8)
    total = args.new_tokens * args.concurrency
    ours_single = args.new_tokens / best(ours_generate, llm, single, args.new_tokens)
    ours_batch = total / best(ours_generate, llm, batch, args.new_tokens)
    return {"int8_single_tok_s": round(ours_single, 2), "int8_single_ratio": round(ours_single / hf_single, 2),
            "int8_batch_tok_s": round(ours_batch, 2), "int8_batch_ratio": round(ours_batch / hf_batch, 2),
            "int8_decode_step_split": decode_split(llm, single[0], 1000 / ours_single)}


def bf16_rows(args, fp32: LLM, single, batch, prefix, hf, pad) -> dict:
    """dtype bfloat16: ours (bf16 products on AMX where the CPU has it: the codes themselves up to 16 rows, weights
    rounded to bf16 past that) vs transformers in bf16 (oneDNN, AMX too) and in fp32, the same prompts; and 16
    sequences, ours in bf16 and fp32."""
    llm = LLM("smollm2", dtype="bfloat16", max_num_seqs=max(64, args.concurrency), enable_prefix_caching=False)
    hf_bf16 = hf.to(torch.bfloat16)
    ours_generate(llm, single, 8)
    hf_generate(hf_bf16, single, 8, pad)
    total = args.new_tokens * args.concurrency
    ours_single = args.new_tokens / best(ours_generate, llm, single, args.new_tokens)
    ours_batch = total / best(ours_generate, llm, batch, args.new_tokens)
    hf_batch = total / best(hf_generate, hf_bf16, batch, args.new_tokens, pad)
    sixteen = batch[:16]
    ours_16 = len(sixteen) * args.new_tokens / best(ours_generate, llm, sixteen, args.new_tokens)
    fp32_16 = len(sixteen) * args.new_tokens / best(ours_generate, fp32, sixteen, args.new_tokens)
    cold = min(time_to_first_token(llm, prefix + make_prompt(llm.tokenizer, 24, s)) for s in (1, 2))
    return {"bf16_amx": "amx_bf16" in open("/proc/cpuinfo").read(), "bf16_single_tok_s": round(ours_single, 2),
            "bf16_batch_tok_s": round(ours_batch, 2), "bf16_batch_tok_s_transformers": round(hf_batch, 2),
            "bf16_batch_vs_transformers_bf16": round(ours_batch / hf_batch, 2),
            "bf16_batch16_tok_s": round(ours_16, 2), "fp32_batch16_tok_s": round(fp32_16, 2),
            "bf16_ttft_cold_s": round(cold, 4)}


if __name__ == "__main__":
    main()
