"""MoE decode on the CPU: a Qwen3-30B-A3B-shaped model of random Q4_K layers (cut to fewer layers and experts so it
fits a small machine, and to a vocabulary of 8,192: a random model's output layer stays fp32, whose 1.2 GB at the
full 151,936 would be most of a step), greedy, at batch 1 to 64, with the experts of a decode step in one C call (cpu_moe.c) vs
the per-expert loop (one quantized matmul per expert and projection), interleaved in one run. One JSON line per
batch. Run: python bench/moe_cpu.py [--layers 12 --experts 32]

--gguf [--llama-cpp-python PATH]: instead, Qwen3-MoE- and Mixtral-shaped Q4_K_M files in llama.cpp's layout, ours
(exact, int8 activations) beside llama.cpp at batch 1 and --concurrency (bench/engine_quantized.py's moe_rows).
"""

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from backend import LLM, SamplingParams  # noqa: E402
from backend.quant import experts  # noqa: E402
from bench.device import SHAPES, model_dir  # noqa: E402


def decode_rate(llm: LLM, batch: int, new_tokens: int) -> float:
    prompts = [[(17 * i + 29 * b) % 8000 + 10 for i in range(16)] for b in range(batch)]
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)  # prompts cached
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    return batch * new_tokens / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batches", default="1,2,4,8,16,32,64")
    parser.add_argument("--gguf", action="store_true")
    parser.add_argument("--shapes", default=None, help="with --gguf: bench/moe_gguf.py's SHAPES, comma-separated "
                        "(default: qwen3_moe,mixtral; qwen3_30b_a3b_shaped is ~0.8 GB)")
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3, help="with --gguf: ours and llama.cpp measured in turn, "
                        "this many times; medians")
    parser.add_argument("--llama-cpp-python", default=os.environ.get("LLAMA_CPP_PYTHON"))
    args = parser.parse_args()
    if args.gguf:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from engine_quantized import moe_rows

        for row in moe_rows(args):
            print(json.dumps({**row, "bench": "moe_cpu"}), flush=True)
        return
    shape = dict(SHAPES["qwen3-30b-a3b-like"], num_hidden_layers=args.layers, num_experts=args.experts,
                 vocab_size=8192)
    with tempfile.TemporaryDirectory() as root:
        llm = LLM(model_dir(Path(root), "qwen3-30b-a3b-like", shape, "Q4_K"), max_model_len=256, max_num_seqs=64)
        shipped = experts.FEW_TOKENS, experts.FEW_TOKENS_NARROW
        for batch in map(int, args.batches.split(",")):
            rates = {"one_call": [], "loop": []}
            for _ in range(args.repeats):
                for name, limit in (("one_call", batch), ("loop", 0)):  # the call whatever the build's tiles
                    experts.FEW_TOKENS = experts.FEW_TOKENS_NARROW = limit
                    rates[name].append(decode_rate(llm, batch, args.new_tokens))
            experts.FEW_TOKENS, experts.FEW_TOKENS_NARROW = shipped
            one, loop = statistics.median(rates["one_call"]), statistics.median(rates["loop"])
            print(json.dumps({"bench": "moe_cpu", "model": f"qwen3-30b-a3b-like/{args.layers}L/{args.experts}E",
                              "format": "Q4_K", "batch": batch, "one_call_tok_s": round(one, 2),
                              "loop_tok_s": round(loop, 2), "speedup": round(one / loop, 2)}), flush=True)


if __name__ == "__main__":
    main()
