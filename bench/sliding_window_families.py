"""The sliding-window families on the CPU in one JSON line (issue 57's benchmark): a gpt-oss-20b-shaped MXFP4 file
(bench/gpt_oss.py: ours with MXFP4 and float experts), a Gemma-3-4B-shaped Q4_K_M file (bench/gemma3.py: ours exact
and with int8 activations), each beside llama.cpp on the same file (prompt tokens/s, decode at batch 1 and 4), and
the KV bytes a 32k-token prompt holds with and without window freeing (bench/kv_window.py). Each part's fields are
those of its own script's line, under "gpt_oss", "gemma3" and "kv_window".

llama.cpp is llama-cpp-python in its own venv (--llama-cpp-python PATH or LLAMA_CPP_PYTHON); with
--llama-cpp-converter PATH (or LLAMA_CPP_CONVERTER) both files are written by llama.cpp's converter and quantizer
from random transformers checkpoints (bench/llama_cpp_convert.py), else by ours.

python bench/sliding_window_families.py [--llama-cpp-python PATH] [--llama-cpp-converter PATH]
    [--gpt-oss-layers 4 --experts 8 --gemma3-layers 6] [--new-tokens 16 --prompt-tokens 256] [--kv-prompt 32768]
"""

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llama-cpp-python", default=os.environ.get("LLAMA_CPP_PYTHON"))
    parser.add_argument(
        "--llama-cpp-converter", help="llama.cpp's convert_hf_to_gguf.py (or LLAMA_CPP_CONVERTER)"
    )
    parser.add_argument("--gpt-oss-layers", type=int, default=4)
    parser.add_argument("--experts", type=int, default=8, help="gpt-oss's experts (the 20b has 32)")
    parser.add_argument("--gemma3-layers", type=int, default=6)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--kv-prompt", type=int, default=32768, help="the prompt whose KV bytes are counted")
    parser.add_argument("--load", default="", help="what else ran on the machine meanwhile, said in the line")
    return parser.parse_args()


def main() -> None:
    import gemma3
    import gpt_oss
    import kv_window

    args = parse_args()
    common = {k: getattr(args, k) for k in ("llama_cpp_python", "llama_cpp_converter", "new_tokens", "load")}
    common["prompt_tokens"] = args.prompt_tokens
    line = {
        "bench": "sliding_window_families",
        "gpt_oss": gpt_oss.row(
            argparse.Namespace(**common, layers=args.gpt_oss_layers, experts=args.experts)
        ),
        "gemma3": gemma3.row(argparse.Namespace(**common, layers=args.gemma3_layers)),
        "kv_window": kv_window.window_freeing(args.kv_prompt, window=1024, step=2048, tokens=8),
    }
    print(json.dumps(line))


if __name__ == "__main__":
    main()
