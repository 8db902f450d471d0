"""Engine vs transformers' generate on the same weights (SmolLM2-135M, fp32, CPU), greedy.

Prints one JSON line: single-request decode speed, 32-request aggregate throughput, and
time to first token with a 1,000-token cached prefix vs cold. Run: python bench/engine.py
"""

import argparse
import json
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


def ours_generate(llm: LLM, prompts: list[list[int]], new_tokens: int) -> float:
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    assert all(len(o.outputs[0].token_ids) == new_tokens for o in outs)
    return elapsed


def time_to_first_token(llm: LLM, prompt: list[int]) -> float:
    start = time.perf_counter()
    llm.generate(prompt, SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--prefix", type=int, default=1000)
    args = parser.parse_args()

    from transformers import AutoModelForCausalLM

    path = pull("smollm2", quiet=True)
    llm = LLM("smollm2", dtype="float32", max_num_seqs=max(64, args.concurrency))
    tokenizer = llm.tokenizer
    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0

    single = [make_prompt(tokenizer, 32, 0)]
    ours_generate(llm, single, 8)  # warm-up both
    hf_generate(hf, single, 8, pad)
    ours_single = args.new_tokens / ours_generate(llm, single, args.new_tokens)
    hf_single = args.new_tokens / hf_generate(hf, single, args.new_tokens, pad)

    batch = [make_prompt(tokenizer, 32, salt) for salt in range(1, args.concurrency + 1)]
    total = args.new_tokens * args.concurrency
    ours_batch = total / ours_generate(llm, batch, args.new_tokens)
    hf_batch = total / hf_generate(hf, batch, args.new_tokens, pad)

    prefix = make_prompt(tokenizer, args.prefix, 99)
    cold_llm = LLM("smollm2", dtype="float32", enable_prefix_caching=False)
    time_to_first_token(cold_llm, prefix[:50])  # warm-up
    cold = min(time_to_first_token(cold_llm, prefix + make_prompt(tokenizer, 24, s)) for s in (1, 2))
    time_to_first_token(llm, prefix + make_prompt(tokenizer, 24, 0))  # fills the cache
    cached = min(time_to_first_token(llm, prefix + make_prompt(tokenizer, 24, s)) for s in (1, 2))

    print(json.dumps({
        "bench": "engine", "model": "smollm2-135m", "dtype": "float32", "device": "cpu",
        "threads": torch.get_num_threads(), "new_tokens": args.new_tokens,
        "single_tok_s": round(ours_single, 2), "single_tok_s_transformers": round(hf_single, 2),
        "single_ratio": round(ours_single / hf_single, 2),
        "batch": args.concurrency, "batch_tok_s": round(ours_batch, 2),
        "batch_tok_s_transformers": round(hf_batch, 2), "batch_ratio": round(ours_batch / hf_batch, 2),
        "prefix_tokens": args.prefix, "ttft_cold_s": round(cold, 4), "ttft_cached_s": round(cached, 4),
        "ttft_speedup": round(cold / cached, 2),
    }))


if __name__ == "__main__":
    main()
