"""gpt-oss's MXFP4 experts on the CPU, one JSON line: a gpt-oss-20b-shaped GGUF in llama.cpp's gpt-oss layout
(hidden 2880, 64 query and 8 key/value heads of 64, experts of 2880, top-4, a 201,088-token vocabulary, the sliding
window of 128 on every other layer; fewer layers and experts than the real model's 24 and 32, by default 4 and 8),
random weights: MXFP4 experts (their biases F32), Q8_0 attention, embeddings and output as llama.cpp's MXFP4_MOE mix
keeps them. Ours with the experts kept in MXFP4 (exact, and with int8 activations: x quantized per group to 8
bits, as llama.cpp multiplies on the CPU) and, on the same values written as F16, held as floats; beside
llama.cpp (llama-cpp-python, a benchmark peer in its own venv: --llama-cpp-python PATH or LLAMA_CPP_PYTHON) on the
MXFP4 file: prompt tokens/s, decode tokens/s at batch 1 and 4 (llama-cpp-python runs the four one after another).

With --llama-cpp-converter PATH (or LLAMA_CPP_CONVERTER) the file is written as a user writes it instead: a random
transformers GptOssForCausalLM of this shape (the 20b's config: YaRN 32 over 4,096, SwiGLU limit 7) through
llama.cpp's convert_hf_to_gguf.py and its quantizer's MXFP4_MOE (bench/llama_cpp_convert.py); the float-experts
file is that file with its MXFP4 experts written as F16. The line's "file" says which writer made them.

python bench/gpt_oss.py [--layers 4] [--experts 8] [--new-tokens 16] [--prompt-tokens 256] [--llama-cpp-converter PATH]
"""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.cut_checkpoint import bf16_by_default, cached_gguf  # noqa: E402
from bench.llama_cpp_convert import CONVERTED, OURS, converted_gguf, converter_from  # noqa: E402

SHAPE = dict(hidden=2880, heads=64, kv_heads=8, head_dim=64, inter=2880, top_k=4, vocab=201088, window=128)


def _q8_0(rng, rows: int, cols: int):
    """Random Q8_0 rows (fp16 scales near 0.02 / 127, every int8 code): what a quantized weight costs to read."""
    import numpy as np

    blocks = rng.integers(-127, 128, size=(rows, cols // 32, 34), dtype=np.int8).view(np.uint8)
    scales = (rng.uniform(0.5, 1.5, size=(rows, cols // 32)) * 0.02 / 127).astype(np.float16)
    blocks[..., :2] = scales[..., None].view(np.uint8)
    return blocks.reshape(rows, -1)


def _mxfp4(rng, experts: int, rows: int, cols: int):
    """Random MXFP4 stacks in GGML's blocks: an E8M0 scale of 2^-8 .. 2^-6, 16 bytes of random codes."""
    import numpy as np

    blocks = rng.integers(0, 256, size=(experts, rows, cols // 32, 17), dtype=np.uint8)
    blocks[..., 0] = rng.integers(119, 122, size=blocks.shape[:-1], dtype=np.uint8)
    return blocks.reshape(experts, rows, -1)


def bench_file(layers: int, experts: int, float_experts: bool) -> Path:
    """The cached file (written on first use); float_experts: the same expert values as F16."""
    name = f"gpt-oss-20b-shaped-{layers}l-{experts}e-{'f16' if float_experts else 'mxfp4'}.gguf"
    return cached_gguf(
        name, lambda scratch, partial: _write(partial, scratch, layers, experts, float_experts)
    )


def converted_files(layers: int, experts: int, converter: Path, python: str | None) -> tuple[Path, Path]:
    """The MXFP4_MOE file llama.cpp's converter and quantizer write from a random checkpoint of this shape, and the
    same file with its MXFP4 experts as F16 (both cached)."""
    import numpy as np
    from engine_quantized import rewritten_gguf  # bench/, beside this script
    from gguf import GGMLQuantizationType as T
    from gguf import LlamaFileType
    from gguf.quants import dequantize

    mxfp4 = converted_gguf(
        f"gpt-oss-20b-shaped-{layers}l-{experts}e-llama.cpp-MXFP4_MOE.gguf",
        lambda hf: _checkpoint(hf, layers, experts),
        "MXFP4_MOE",
        converter,
        python,
    )

    def tensor(_, t):
        if t.tensor_type == T.MXFP4:
            return dequantize(t.data, T.MXFP4).astype(np.float16), None
        numpy_typed = t.tensor_type in (T.F32, T.F16)  # the reader gives other types as raw bytes
        return np.asarray(t.data), None if numpy_typed else t.tensor_type

    floats = rewritten_gguf(
        mxfp4, mxfp4.with_name(f"{mxfp4.stem}-f16-experts.gguf"), LlamaFileType.MOSTLY_F16, tensor
    )
    return mxfp4, floats


def _checkpoint(directory: Path, layers: int, experts: int) -> None:
    """A random GptOssForCausalLM of SHAPE (sliding and full layers alternating), saved in bf16."""
    import torch
    from transformers import GptOssConfig, GptOssForCausalLM

    from tests.backend.tiny_models import build_tokenizer

    s = SHAPE
    config = GptOssConfig(
        hidden_size=s["hidden"],
        intermediate_size=s["inter"],
        num_attention_heads=s["heads"],
        num_key_value_heads=s["kv_heads"],
        head_dim=s["head_dim"],
        num_local_experts=experts,
        num_experts_per_tok=s["top_k"],
        vocab_size=s["vocab"],
        sliding_window=s["window"],
        num_hidden_layers=layers,
        layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)],
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 150000.0,
            "factor": 32.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 4096,
        },
        max_position_embeddings=131072,
        rms_norm_eps=1e-5,
        swiglu_limit=7.0,
        initializer_range=0.02,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    with bf16_by_default(), torch.no_grad():  # 2B parameters at the default cut: 8 GB in fp32
        GptOssForCausalLM(config).save_pretrained(str(directory))
    build_tokenizer(directory)


def _write(partial: Path, scratch: Path, layers: int, experts: int, float_experts: bool) -> None:
    import numpy as np
    from gguf import GGMLQuantizationType as T
    from gguf import GGUFWriter, RopeScalingType
    from gguf.quants import dequantize

    from tests.backend.tiny_gguf_parts import add_tokenizer, close
    from tests.backend.tiny_models import build_tokenizer

    s = SHAPE
    build_tokenizer(scratch)
    rng = np.random.default_rng(0)
    w = GGUFWriter(str(partial), "gpt-oss")
    w.add_context_length(131072)
    w.add_embedding_length(s["hidden"])
    w.add_feed_forward_length(s["inter"])
    w.add_block_count(layers)
    w.add_head_count(s["heads"])
    w.add_head_count_kv(s["kv_heads"])
    w.add_key_length(s["head_dim"])
    w.add_value_length(s["head_dim"])
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(150000.0)
    w.add_rope_scaling_type(RopeScalingType.YARN)
    w.add_rope_scaling_factor(32.0)
    w.add_rope_scaling_orig_ctx_len(4096)
    w.add_expert_count(experts)
    w.add_expert_used_count(s["top_k"])
    w.add_expert_feed_forward_length(s["inter"])
    w.add_sliding_window(s["window"])
    w.add_vocab_size(s["vocab"])
    add_tokenizer(w, {"vocab_size": s["vocab"], "bos_token_id": 1, "eos_token_id": 2}, scratch)

    def f32(name: str, *shape: int, scale: float = 0.02):
        w.add_tensor(name, (rng.standard_normal(shape) * scale).astype(np.float32))

    w.add_tensor("token_embd.weight", _q8_0(rng, s["vocab"], s["hidden"]), raw_dtype=T.Q8_0)
    q, kv = s["heads"] * s["head_dim"], s["kv_heads"] * s["head_dim"]
    for i in range(layers):
        b = f"blk.{i}"
        w.add_tensor(f"{b}.attn_norm.weight", np.ones(s["hidden"], dtype=np.float32))
        w.add_tensor(f"{b}.post_attention_norm.weight", np.ones(s["hidden"], dtype=np.float32))
        for name, rows, cols in (
            ("attn_q", q, s["hidden"]),
            ("attn_k", kv, s["hidden"]),
            ("attn_v", kv, s["hidden"]),
            ("attn_output", s["hidden"], q),
        ):
            w.add_tensor(f"{b}.{name}.weight", _q8_0(rng, rows, cols), raw_dtype=T.Q8_0)
            f32(f"{b}.{name}.bias", rows)
        f32(f"{b}.attn_sinks.weight", s["heads"], scale=1.0)
        f32(f"{b}.ffn_gate_inp.weight", experts, s["hidden"])
        f32(f"{b}.ffn_gate_inp.bias", experts)
        for name in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"):
            rows, cols = (s["hidden"], s["inter"]) if name == "ffn_down_exps" else (s["inter"], s["hidden"])
            blocks = _mxfp4(rng, experts, rows, cols)
            if float_experts:
                w.add_tensor(f"{b}.{name}.weight", dequantize(blocks, T.MXFP4).astype(np.float16))
            else:
                w.add_tensor(f"{b}.{name}.weight", blocks, raw_dtype=T.MXFP4)
            f32(f"{b}.{name}.bias", experts, rows)
    w.add_tensor("output_norm.weight", np.ones(s["hidden"], dtype=np.float32))
    w.add_tensor("output.weight", _q8_0(rng, s["vocab"], s["hidden"]), raw_dtype=T.Q8_0)
    close(w)


def row(args) -> dict:
    """The line's fields for parse_args' flags (beside_llama_cpp.py): ours with MXFP4 and float experts,
    llama.cpp's on the MXFP4 file."""
    from beside_llama_cpp import opening, ours, prompt_ids, with_peer  # bench/, beside this

    prompt = prompt_ids(args.prompt_tokens)
    converter = converter_from(args.llama_cpp_converter)
    if converter is None:
        mxfp4 = bench_file(args.layers, args.experts, float_experts=False)
        floats = bench_file(args.layers, args.experts, float_experts=True)
    else:
        mxfp4, floats = converted_files(args.layers, args.experts, converter, args.llama_cpp_python)
    line = opening("gpt-oss", SHAPE, mxfp4, args, experts=args.experts, file=CONVERTED if converter else OURS)
    line["ours_mxfp4_experts"] = ours(mxfp4, prompt, args.new_tokens)
    line["ours_mxfp4_experts_int8"] = ours(mxfp4, prompt, args.new_tokens, activations="int8")
    line["ours_float_experts"] = ours(floats, prompt, args.new_tokens)
    return with_peer(line, mxfp4, prompt, args)


def main() -> None:
    from beside_llama_cpp import parse_args  # bench/, beside this

    print(json.dumps(row(parse_args(__doc__.splitlines()[0], layers=4, experts=8))))


if __name__ == "__main__":
    main()
