"""Gemma 3 on the CPU, ours beside llama.cpp on the same Q4_K_M file, one JSON line: a Gemma-3-4B-shaped checkpoint
(hidden 2560, 8 query and 4 key/value heads of 256, MLP 10240, the 262,208-token vocabulary, query_pre_attn_scalar
256, a 1,024-token window on the local layers, local rotary base 10,000 and the global 1,000,000 scaled linearly by 8)
with fewer layers than the 4B's 34 (by default 6, Gemma 3's five local layers then one global), random weights: built
by transformers' Gemma3ForCausalLM, written in llama.cpp's gemma3 layout by the tests' copy of its converter
(tests/backend/tiny_gguf_gemma3.py: norms as 1 + w, tied output) in Q4_K_M's formats (Q6_K for attn_v, ffn_down and
the tied embedding that is also the output, Q4_K elsewhere; the K-quant blocks drawn at random as bench/moe_gguf.py
draws them). Prompt tokens/s and decode tokens/s at batch 1 and 4, ours exact and with int8 activations, llama.cpp's
(llama-cpp-python, a benchmark peer in its own venv: --llama-cpp-python PATH or LLAMA_CPP_PYTHON; it serves one
sequence at a time, so its batch-4 figure is four requests one after another).

With --llama-cpp-converter PATH (or LLAMA_CPP_CONVERTER) the file is written as a user writes it instead: the same
checkpoint through llama.cpp's convert_hf_to_gguf.py and its quantizer's Q4_K_M (bench/llama_cpp_convert.py); the
line's "file" says which writer made it.

python bench/gemma3.py [--layers 6] [--new-tokens 16] [--prompt-tokens 256] [--llama-cpp-converter PATH]
"""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.cut_checkpoint import PUBLISHED, cached_gguf, random_bf16_checkpoint  # noqa: E402
from bench.llama_cpp_convert import CONVERTED, OURS, converted_gguf, converter_from  # noqa: E402

GEMMA3_4B = PUBLISHED["gemma-3-4b"]  # its config.json's text_config
ROPE = {
    "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
    "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
}


def _checkpoint(directory: Path, layers: int) -> None:
    """A random Gemma3ForCausalLM of this shape, five local layers to one global."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    kinds = ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(layers)]
    config = Gemma3TextConfig(
        **GEMMA3_4B,
        num_hidden_layers=layers,
        layer_types=kinds,
        rope_parameters=ROPE,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    random_bf16_checkpoint(Gemma3ForCausalLM, config, directory)


def bench_file(layers: int) -> Path:
    """The cached Q4_K_M file (written on first use, under the data directory's cache/bench)."""

    def write(scratch: Path, partial: Path) -> None:
        from gguf import GGMLQuantizationType as T
        from gguf import GGUFWriter
        from safetensors import safe_open

        from tests.backend.quant_blocks import random_raw
        from tests.backend.tiny_gguf_gemma3 import _NAMES, POLICIES, _metadata
        from tests.backend.tiny_gguf_parts import close

        policy = POLICIES["Q4_K_M"]
        hf = scratch / "hf"
        _checkpoint(hf, layers)
        cfg = json.loads((hf / "config.json").read_text())
        w = GGUFWriter(str(partial), "gemma3")
        _metadata(w, cfg, hf)
        with safe_open(str(hf / "model.safetensors"), framework="pt") as f:
            for n, name in enumerate(sorted(f.keys())):
                parts = name.split(".")
                if name == "model.embed_tokens.weight":
                    gname = "token_embd.weight"
                elif name == "model.norm.weight":
                    gname = "output_norm.weight"
                else:
                    gname = f"blk.{parts[2]}.{_NAMES['.'.join(parts[3:-1])]}.{parts[-1]}"
                fmt = policy.get(gname.split(".")[-2])
                if fmt is None:  # norms: the converter stores Gemma3RMSNorm's 1 + w
                    w.add_tensor(gname, f.get_tensor(name).float().numpy() + 1.0)
                    continue
                rows, cols = f.get_slice(name).get_shape()
                w.add_tensor(gname, random_raw(fmt, rows, cols, seed=n), raw_dtype=getattr(T, fmt))
        close(w)

    return cached_gguf(f"gemma-3-4b-shaped-{layers}l-Q4_K_M.gguf", write)


def converted_file(layers: int, converter: Path, python: str | None) -> Path:
    """The same checkpoint through llama.cpp's converter and quantizer (Q4_K_M), cached."""
    return converted_gguf(
        f"gemma-3-4b-shaped-{layers}l-llama.cpp-Q4_K_M.gguf",
        lambda hf: _checkpoint(hf, layers),
        "Q4_K_M",
        converter,
        python,
    )


def row(args) -> dict:
    """The line's fields for parse_args' flags (beside_llama_cpp.py): ours exact and int8, llama.cpp's."""
    from beside_llama_cpp import opening, ours, prompt_ids, with_peer  # bench/, beside this

    prompt = prompt_ids(args.prompt_tokens)
    converter = converter_from(args.llama_cpp_converter)
    if converter is None:
        path = bench_file(args.layers)
    else:
        path = converted_file(args.layers, converter, args.llama_cpp_python)
    line = opening(
        "gemma3",
        GEMMA3_4B,
        path,
        args,
        layer_kinds="5 local : 1 global",
        file=CONVERTED if converter else OURS,
    )
    line["ours_exact"] = ours(path, prompt, args.new_tokens)
    line["ours_int8"] = ours(path, prompt, args.new_tokens, activations="int8")
    return with_peer(line, path, prompt, args)


def main() -> None:
    from beside_llama_cpp import parse_args  # bench/, beside this

    print(json.dumps(row(parse_args(__doc__.splitlines()[0], layers=6))))


if __name__ == "__main__":
    main()
