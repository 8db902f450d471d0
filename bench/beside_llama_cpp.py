"""Ours beside llama.cpp on one GGUF file on the CPU, one JSON line: what bench/gemma3.py and bench/gpt_oss.py
share (their flags, the prompt, our rates and llama.cpp's, the line's opening and its peer part). llama.cpp is
llama-cpp-python, a benchmark peer in its own venv (--llama-cpp-python PATH or LLAMA_CPP_PYTHON); it serves one
sequence at a time, so its batch-4 figure is four requests one after another."""

import argparse
import json
import os
from pathlib import Path


def parse_args(description: str, layers: int, **counts: int) -> argparse.Namespace:
    """The flags: --layers (and each of counts, e.g. experts=8, as --experts) of the cut, the tokens to run."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--llama-cpp-python", default=os.environ.get("LLAMA_CPP_PYTHON"))
    parser.add_argument(
        "--llama-cpp-converter",
        help="llama.cpp's convert_hf_to_gguf.py: write the file through it (or LLAMA_CPP_CONVERTER)",
    )
    parser.add_argument("--layers", type=int, default=layers)
    for name, default in counts.items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=default)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--load", default="", help="what else ran on the machine meanwhile, said in the line")
    return parser.parse_args()


def prompt_ids(tokens: int) -> list[int]:
    """A prompt of token ids within the tests' small tokenizer's 400."""
    return [(17 * i + 3) % 400 + 3 for i in range(tokens)]


def opening(bench: str, shape: dict, path: Path, args: argparse.Namespace, **cut) -> dict:
    """The line's first fields: the bench, the machine, the shape and its cut, the run's sizes, the file's."""
    import torch

    return {
        "bench": bench,
        "device": "cpu",
        "threads": torch.get_num_threads(),
        "shape": dict(shape),
        "layers": args.layers,
        **cut,
        "weights": "random",
        "new_tokens": args.new_tokens,
        "prompt_tokens": args.prompt_tokens,
        "file_gib": round(path.stat().st_size / 2**30, 3),
    }


def with_peer(line: dict, path: Path, prompt: list[int], args: argparse.Namespace) -> dict:
    """The line, with llama.cpp's rates on path (or "peer": "missing") and the load it ran under."""
    peer = args.llama_cpp_python
    line["peer"] = "llama.cpp" if peer else "missing"
    if peer:
        line["llama_cpp"] = llama_cpp(path, prompt, args.new_tokens, peer)
    if args.load:
        line["under_load"] = args.load
    return line


def print_with_peer(line: dict, path: Path, prompt: list[int], args: argparse.Namespace) -> None:
    print(json.dumps(with_peer(line, path, prompt, args)))


def ours(path: Path, prompt: list[int], new_tokens: int, **settings) -> dict:
    """settings: more of LLM's arguments (activations="int8")."""
    from engine_vs_peers import best, ours_decode_rate, ours_generate  # bench/, beside this script

    from backend import LLM

    llm = LLM(str(path), max_model_len=len(prompt) + new_tokens + 64, enable_prefix_caching=False, **settings)
    ours_generate(llm, [prompt[:32]], 4)  # warm-up: kernels built, first allocations made
    batch = [prompt[i * 8 : i * 8 + 32] for i in range(4)]
    batch_s = best(ours_generate, llm, batch, new_tokens + 1) - best(ours_generate, llm, batch, 1)
    return {
        "prompt_tok_s": round(len(prompt) / best(ours_generate, llm, [prompt], 1), 2),
        "decode_b1_tok_s": round(ours_decode_rate(llm, prompt[:32], new_tokens), 2),
        "decode_b4_tok_s": round(4 * new_tokens / batch_s, 2),
    }


def llama_cpp(path: Path, prompt: list[int], new_tokens: int, python: str) -> dict:
    import torch
    from run_peer import run_peer  # bench/, beside this script

    threads = torch.get_num_threads()
    job = {
        "action": "rates",
        "model": str(path),
        "prompt": prompt,
        "new_tokens": new_tokens,
        "threads": threads,
    }
    rates = run_peer("llama_cpp_iq_peer.py", job, python)
    batch = run_peer(
        "llama_cpp_peer.py",
        {"model": str(path), "prompts": [prompt[:32]] * 5, "new_tokens": new_tokens, "threads": threads},
        python,
    )
    return {
        "prompt_tok_s": round(rates["prompt_tok_s"], 2),
        "decode_b1_tok_s": round(rates["decode_tok_s"], 2),
        "decode_b4_tok_s": round(batch["batch_tok_s"], 2),
        **{k: v for k, v in rates.items() if k == "extra_buffers"},
    }
