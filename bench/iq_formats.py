"""The codebook formats side by side with llama.cpp, one JSON line: SmolLM2-135M and a Qwen3-30B-A3B-shaped MoE file
(bench/iq_moe_file.py: the 30B's layer and expert widths, 32 of its experts, --moe-layers of its 48 layers) in
llama.cpp's IQ4_XS and IQ3_XS mixes (and MXFP4_MOE for the MoE file): batch-1 decode and prompt tokens/s, ours vs
llama.cpp on the same files, on the CPU.

With --llama-cpp-python PATH (or LLAMA_CPP_PYTHON: the python of a venv holding llama-cpp-python, a benchmark peer,
never a dependency) llama.cpp's own quantizer makes the files (bench/llama_cpp_iq_peer.py, requantizing the source
file) and measures its rates on them; where it refuses a mix (IQ3_XS of the MoE file: its IQ3_XXS tensors want an
importance matrix, which the library cannot be handed) the row's "file" says so and both read our file of the mix,
below. Without it the row says "peer": "missing" and the files are ours: each
quantized tensor rewritten as random blocks of the format llama.cpp's mix would pick (llama_tensor_get_type,
approximated: IQ4_XS everywhere; IQ3_XS as IQ3_S with IQ3_XXS gate/up and an IQ4_XS attn_v; MXFP4 experts and Q8_0
elsewhere; Q6_K output; rows not of whole 256-blocks in IQ4_NL, or Q8_0 for Q6_K, as llama.cpp falls back), whose
speed is that of real weights of the same formats.

Ours in each of --activations' modes, on the same file in the same run: "exact" (fp32 activations: an exact matmul,
x in three 8-bit digits where the CPU has VNNI) and "int8" (x quantized per group to 8 bits, as llama.cpp itself
multiplies on the CPU: the like-for-like mode), or both (the default), each row's "ours" keyed by mode.

python bench/iq_formats.py [--llama-cpp-python PATH] [--moe-layers 4] [--new-tokens 32] [--prompt-tokens 256]
                          [--models smollm2,moe] [--mixes IQ4_XS,IQ3_XS,MXFP4_MOE] [--activations exact|int8|both]
"""

import argparse
import json
import os
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

MIXES = {"IQ4_XS": 30, "IQ3_XS": 22, "MXFP4_MOE": 38}  # llama.cpp's llama_ftype of each
MODES = {"exact": {}, "int8": {"activations": "int8"}}  # our engine's settings in each --activations mode
_FLOATS = ("F32", "F16", "BF16")


def mix_format(mix: str, kind: str, cols: int) -> str:
    """Our approximation of the format llama.cpp's mix gives a tensor of this kind and row length."""
    if mix == "MXFP4_MOE":
        return "MXFP4" if kind.endswith("_exps") else "Q8_0"
    if kind == "output":
        fmt = "Q6_K"
    elif mix == "IQ4_XS" or kind == "attn_v":
        fmt = "IQ4_XS"
    else:
        fmt = "IQ3_XXS" if kind in ("ffn_gate", "ffn_up", "ffn_gate_exps", "ffn_up_exps") else "IQ3_S"
    if cols % 256:
        return "Q8_0" if fmt == "Q6_K" else "IQ4_NL"
    return fmt


def random_mix_copy(source: Path, mix: str) -> Path:
    """source with its quantized tensors rewritten as random blocks of mix_format's choice (metadata copied),
    cached beside the other bench files."""
    import gguf
    import numpy as np
    from engine_quantized import rewritten_gguf  # bench/, beside this script

    from backend.home import cache_dir
    from tests.backend.quant_blocks import random_raw

    def tensor(i: int, t) -> tuple[np.ndarray, object]:
        if t.tensor_type.name in _FLOATS:
            return np.asarray(t.data), None
        cols, rows, *lead = (int(s) for s in t.shape)
        fmt = mix_format(mix, t.name.split(".")[-2], cols)
        return random_raw(fmt, rows, cols, seed=i, lead=tuple(reversed(lead))), gguf.GGMLQuantizationType[fmt]

    out = cache_dir() / "bench" / f"{source.stem}-{mix}-random.gguf"
    return rewritten_gguf(source, out, MIXES[mix], tensor)


def llama_cpp_copy(source: Path, mix: str, python: str) -> Path:
    """source requantized by llama.cpp's quantizer into the mix, cached."""
    import torch
    from run_peer import run_peer  # bench/, beside this script

    from backend.home import cache_dir

    out = cache_dir() / "bench" / f"{source.stem}-{mix}-llama.cpp.gguf"
    if not out.exists():
        partial = Path(str(out) + ".partial")
        run_peer(
            "llama_cpp_iq_peer.py",
            {
                "action": "quantize",
                "source": str(source),
                "out": str(partial),
                "ftype": MIXES[mix],
                "threads": torch.get_num_threads(),
            },
            python,
        )
        partial.replace(out)
    return out


def ours(path: Path, prompt: list[int], new_tokens: int, **settings) -> tuple[float, float]:
    """(prompt tokens/s, batch-1 decode tokens/s) of our engine on the file, made with `settings`."""
    from engine_vs_peers import best, ours_decode_rate, ours_generate

    from backend import LLM

    llm = LLM(str(path), max_model_len=len(prompt) + new_tokens + 64, enable_prefix_caching=False, **settings)
    ours_generate(llm, [prompt[:32]], 4)  # warm-up: kernels built, first allocations made
    decode = ours_decode_rate(llm, prompt[:32], new_tokens)
    return len(prompt) / best(ours_generate, llm, [prompt], 1), decode


def row(model: str, mix: str, path: Path, prompt: list[int], args) -> dict:
    import gguf
    import torch
    from run_peer import run_peer

    reader = gguf.GGUFReader(str(path))
    formats = Counter(t.tensor_type.name for t in reader.tensors if t.tensor_type.name not in _FLOATS)
    out = {"model": model, "mix": mix, "gib": round(path.stat().st_size / 2**30, 3), "formats": dict(formats)}
    modes = list(MODES) if args.activations == "both" else [args.activations]
    out["ours"] = {}
    for mode in modes:
        prompt_rate, decode_rate = ours(path, prompt, args.new_tokens, **MODES[mode])
        out["ours"][mode] = {"prompt_tok_s": round(prompt_rate, 2), "decode_tok_s": round(decode_rate, 2)}
    if args.llama_cpp_python:
        peer = run_peer(
            "llama_cpp_iq_peer.py",
            {
                "action": "rates",
                "model": str(path),
                "prompt": prompt,
                "new_tokens": args.new_tokens,
                "threads": torch.get_num_threads(),
            },
            args.llama_cpp_python,
        )
        out["llama_cpp_prompt_tok_s"] = round(peer["prompt_tok_s"], 2)
        out["llama_cpp_decode_tok_s"] = round(peer["decode_tok_s"], 2)
        if "extra_buffers" in peer:
            out["llama_cpp_extra_buffers"] = peer["extra_buffers"]
        for rates in out["ours"].values():
            rates["prompt_vs_llama_cpp"] = round(rates["prompt_tok_s"] / out["llama_cpp_prompt_tok_s"], 2)
            rates["decode_vs_llama_cpp"] = round(rates["decode_tok_s"] / out["llama_cpp_decode_tok_s"], 2)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llama-cpp-python", default=os.environ.get("LLAMA_CPP_PYTHON"))
    parser.add_argument(
        "--moe-layers", type=int, default=4, help="layers of the Qwen3-30B-A3B-shaped file (48 in the 30B)"
    )
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument(
        "--models", default="smollm2,moe", help="which rows: smollm2, moe or both (comma-separated)"
    )
    parser.add_argument("--mixes", default=",".join(MIXES), help="which of the mixes (comma-separated)")
    parser.add_argument(
        "--activations",
        choices=[*MODES, "both"],
        default="both",
        help="ours with exact (fp32) activations, int8 ones (llama.cpp's own arithmetic), or both",
    )
    args = parser.parse_args()
    import torch
    from iq_moe_file import qwen3_30b_a3b_cut

    from backend.model_store import pull

    wanted = set(args.models.split(","))
    sources = {}
    if "smollm2" in wanted:
        sources["smollm2-135m"] = (pull("smollm2", quiet=True), ("IQ4_XS", "IQ3_XS"))
    if "moe" in wanted:
        sources[f"qwen3-30b-a3b-shaped-{args.moe_layers}l"] = (
            qwen3_30b_a3b_cut(args.moe_layers),
            ("IQ4_XS", "IQ3_XS", "MXFP4_MOE"),
        )
    prompt = [(17 * i + 3) % 400 + 3 for i in range(args.prompt_tokens)]
    rows = []
    for model, (source, mixes) in sources.items():
        for mix in (m for m in args.mixes.split(",") if m in mixes):
            file, path = "llama.cpp's quantizer", None
            if args.llama_cpp_python:
                # IQ3_XS on whole 256-blocks has IQ3_XXS tensors, for which llama.cpp wants an importance matrix
                # (the library takes none): then our mix, read by both
                try:
                    path = llama_cpp_copy(source, mix, args.llama_cpp_python)
                except SystemExit as e:
                    file = f"random blocks, our mix ({e})"
            if path is None:
                path = random_mix_copy(source, mix)
                if not args.llama_cpp_python:
                    file = "random blocks, our mix"
            rows.append({**row(model, mix, path, prompt, args), "file": file})
            # each row as it is measured (a run takes minutes)
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    print(
        json.dumps(
            {
                "bench": "iq-formats",
                "device": "cpu",
                "threads": torch.get_num_threads(),
                "peer": "llama.cpp" if args.llama_cpp_python else "missing",
                "new_tokens": args.new_tokens,
                "prompt_tokens": args.prompt_tokens,
                "rows": rows,
            }
        )
    )


if __name__ == "__main__":
    main()
