"""Decode speed after a long prompt on the CPU (an agent's turn: a prompt of thousands of tokens, then its reply),
SmolLM2 Q4_1 (the embedded default), ours beside llama.cpp on the same file: ours with fp32 activations (exact)
and with int8 ones, our default KV cache (fp32) and fp16; llama.cpp with its default f16 cache, flash attention
off and on (null without --llama-cpp-python). The prompt's evaluation is left out of every figure; each engine
measured in turn, --rounds times, medians. One JSON line per context length.

    python bench/long_decode.py [--contexts 1000,4000,8000] [--llama-cpp-python /path/to/venv/bin/python]
"""

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
from engine_vs_peers import ours_decode_rate  # noqa: E402  (bench/, beside this script)
from run_peer import run_peer  # noqa: E402

from backend import LLM  # noqa: E402
from backend.model_store import pull  # noqa: E402

OURS = {"exact": {}, "int8": {"activations": "int8"}, "exact_fp16_cache": {"kv_cache_dtype": "float16"},
        "int8_fp16_cache": {"activations": "int8", "kv_cache_dtype": "float16"}}


def llama_cpp_rate(path: Path, prompt: list[int], new_tokens: int, flash_attn: bool,
                   python: str | None) -> float | None:
    if not python:
        return None
    job = {"model": str(path), "prompt": prompt, "new_tokens": new_tokens, "threads": torch.get_num_threads(),
           "n_ctx": len(prompt) + new_tokens + 16, "flash_attn": flash_attn}
    return run_peer("llama_cpp_long.py", job, python)["decode_tok_s"]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--contexts", default="1000,4000,8000")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--llama-cpp-python", default=os.environ.get("LLAMA_CPP_PYTHON"))
    args = parser.parse_args()
    path = pull("smollm2", quiet=True)
    for context in map(int, args.contexts.split(",")):
        prompt = [(17 * i + 3) % 40000 + 3 for i in range(context)]
        engines = {name: LLM(str(path), max_num_seqs=4, max_model_len=context + args.new_tokens + 16, **settings)
                   for name, settings in OURS.items()}
        rates: dict[str, list] = {name: [] for name in [*engines, "llama_cpp", "llama_cpp_flash_attn"]}
        for _ in range(args.rounds):
            for name, llm in engines.items():
                rates[name].append(ours_decode_rate(llm, prompt, args.new_tokens))
            for name, flash in (("llama_cpp", False), ("llama_cpp_flash_attn", True)):
                rates[name].append(llama_cpp_rate(path, prompt, args.new_tokens, flash, args.llama_cpp_python))
        del engines
        row = {"bench": "long_decode", "model": path.name, "device": "cpu", "threads": torch.get_num_threads(),
               "context": context, "new_tokens": args.new_tokens, "rounds": args.rounds}
        for name, runs in rates.items():
            row[f"{name}_tok_s"] = None if None in runs else round(statistics.median(runs), 2)
        peer = max((row[k] for k in ("llama_cpp_tok_s", "llama_cpp_flash_attn_tok_s") if row[k]), default=None)
        for name in OURS:
            row[f"{name}_vs_llama_cpp_best"] = round(row[f"{name}_tok_s"] / peer, 2) if peer else None
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
