"""gpt-oss's MXFP4 experts on the CPU, one JSON line: a gpt-oss-20b-shaped GGUF in llama.cpp's gpt-oss layout
(hidden 2880, 64 query and 8 key/value heads of 64, experts of 2880, top-4, a 201,088-token vocabulary, the sliding
window of 128 on every other layer; fewer layers and experts than the real model's 24 and 32, by default 4 and 8),
random weights: MXFP4 experts (their biases F32), Q8_0 attention, embeddings and output as llama.cpp's MXFP4_MOE mix
keeps them. Ours with the experts kept in MXFP4 and, on the same values written as F16, held as floats; beside
llama.cpp (llama-cpp-python, a benchmark peer in its own venv: --llama-cpp-python PATH or LLAMA_CPP_PYTHON) on the
MXFP4 file: prompt tokens/s, decode tokens/s at batch 1 and 4 (llama-cpp-python runs the four one after another).

python bench/gpt_oss.py [--layers 4] [--experts 8] [--new-tokens 16] [--prompt-tokens 256]
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.cut_checkpoint import cached_gguf  # noqa: E402

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


def main() -> None:
    from beside_llama_cpp import opening, ours, parse_args, print_with_peer, prompt_ids  # bench/, beside this

    args = parse_args(__doc__.splitlines()[0], layers=4, experts=8)
    prompt = prompt_ids(args.prompt_tokens)
    mxfp4 = bench_file(args.layers, args.experts, float_experts=False)
    line = opening("gpt-oss", SHAPE, mxfp4, args, experts=args.experts)
    line["ours_mxfp4_experts"] = ours(mxfp4, prompt, args.new_tokens)
    line["ours_float_experts"] = ours(
        bench_file(args.layers, args.experts, float_experts=True), prompt, args.new_tokens
    )
    print_with_peer(line, mxfp4, prompt, args)


if __name__ == "__main__":
    main()
