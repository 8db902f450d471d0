"""Multi-head latent attention on the CPU: a DeepSeek-V2-Lite-shaped Q4_K_M GGUF of random weights in llama.cpp's
deepseek2 layout (tests/backend/tiny_gguf_deepseek.py writes it as its converter does, kv_b split in attn_k_b and
attn_v_b): V2-Lite's 27 layers and widths, with fewer routed experts (8 of its 64 by default, top-6 kept) and a
smaller vocabulary, so that the file is about 1.5 GB; the row says which. llama.cpp reads a deepseek2 file without
q_lora_rank only at V2-Lite's 27 layers (its loader's is_lite), so a cut to fewer layers runs ours alone.

One JSON line: our decode at batch 1 and 4 and prompt tokens/s, llama.cpp's on the same file beside them
(llama-cpp-python in its own venv, --llama-cpp-python PATH or LLAMA_CPP_PYTHON; "peer": "missing" without it; it
serves one sequence at a time, so its batch-4 figure is four sequences one after another), and the KV bytes a token
against an MHA model of the same width.

With --llama-cpp-converter PATH (or LLAMA_CPP_CONVERTER) the file is written as a user writes it instead: the same
random checkpoint through llama.cpp's convert_hf_to_gguf.py and its quantizer's Q4_K_M (bench/llama_cpp_convert.py),
with GPT-2's 50,257-token vocabulary (the converter accepts only a tokenizer it knows); the row's "file" says which
writer made it.

Run: python bench/mla.py [--layers 27 --experts 8] [--activations int8] [--llama-cpp-python PATH]
     [--llama-cpp-converter PATH]
"""

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from backend import LLM, SamplingParams  # noqa: E402
from backend.engine.kv_budget import kv_bytes_per_block  # noqa: E402
from bench import cut_checkpoint as cut  # noqa: E402
from bench import llama_cpp_convert as llama_convert  # noqa: E402

# DeepSeek-V2-Lite's widths (hidden 2048, 16 heads, latent 512 + 64 rotary, 128-wide nope and v, experts of 1408,
# 2 shared, top-6, a dense first layer), with a smaller vocabulary and context
LITE = dict(cut.PUBLISHED["deepseek-v2-lite"], max_position_embeddings=4096, vocab_size=8192)
# the latent attention's kinds (q in one projection: V2-Lite has no q_lora_rank)
MLA_ATTENTION = ("attn_q", "attn_output", "attn_kv_a_mqa")
# llama.cpp's Q4_K_M (the kv_b halves' rows hold no whole 256-blocks: Q8_0, as its quantizer falls back)
Q4_K_M = cut.q4_k_m(
    *cut.ENDS,
    *MLA_ATTENTION,
    *cut.DENSE_MLP,
    *cut.EXPERTS,
    *cut.SHARED_EXPERT,
    attn_k_b="Q8_0",
    attn_v_b="Q8_0",
)


def lite_shape(layers: int, experts: int, vocab: int) -> dict:
    """V2-Lite's config cut to this many layers and routed experts and this vocabulary."""
    return dict(
        LITE,
        num_hidden_layers=layers,
        n_routed_experts=experts,
        num_experts_per_tok=min(6, experts),
        vocab_size=vocab,
    )


def _checkpoint(directory: Path, shape: dict) -> Path:
    from tests.backend.tiny_models import build_model

    # built and saved in bf16: at 27 layers the checkpoint is 2.7B parameters (11 GB in fp32)
    with cut.bf16_by_default():
        return build_model("deepseek_v2", directory, initializer_range=0.02, **shape)


def lite_file(layers: int, experts: int) -> Path:
    """The cached file (written on first use) under the data directory's cache/bench."""
    from tests.backend.tiny_gguf_deepseek import convert

    shape = lite_shape(layers, experts, LITE["vocab_size"])

    def write(scratch: Path, partial: Path) -> None:
        convert(_checkpoint(scratch / "hf", shape), partial, split=True, policy=Q4_K_M, reference=False)

    return cut.cached_gguf(f"deepseek-v2-lite-shaped-{cut.shape_key(shape, Q4_K_M)}-Q4_K_M.gguf", write)


def converted_lite_file(layers: int, experts: int, converter: Path, python: str | None) -> Path:
    """The same checkpoint, with GPT-2's vocabulary, through llama.cpp's converter and quantizer (cached)."""
    shape = lite_shape(layers, experts, llama_convert.VOCABULARIES["gpt-2"])
    return llama_convert.converted_gguf(
        f"deepseek-v2-lite-shaped-{cut.shape_key(shape)}-llama.cpp-Q4_K_M.gguf",
        lambda hf: _checkpoint(hf, shape),
        "Q4_K_M",
        converter,
        python,
    )


def rate(llm: LLM, prompts: list[list[int]], new_tokens: int, rounds: int) -> float:
    """The best of `rounds` runs: a shared machine's other work only ever slows one down."""
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)  # prompts cached
    best = 0.0
    for _ in range(rounds):
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        best = max(best, len(prompts) * new_tokens / (time.perf_counter() - start))
    return best


def prompt_rate(path: Path, prompt: list[int], rounds: int, activations: str) -> float:
    llm = LLM(str(path), max_model_len=2048, enable_prefix_caching=False, activations=activations)
    llm.generate([prompt], SamplingParams(max_tokens=1), use_tqdm=False)  # warm
    best = 0.0
    for _ in range(rounds):
        start = time.perf_counter()
        llm.generate([prompt], SamplingParams(max_tokens=1), use_tqdm=False)
        best = max(best, len(prompt) / (time.perf_counter() - start))
    return best


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=27)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--llama-cpp-python", default=os.environ.get("LLAMA_CPP_PYTHON"))
    parser.add_argument(
        "--activations", default="float32", help="ours: float32 (exact) or int8 (llama.cpp's own arithmetic)"
    )
    parser.add_argument(
        "--llama-cpp-converter", help="llama.cpp's convert_hf_to_gguf.py (or LLAMA_CPP_CONVERTER)"
    )
    args = parser.parse_args()
    converter = llama_convert.converter_from(args.llama_cpp_converter)
    if converter is None:
        path = lite_file(args.layers, args.experts)
    else:
        path = converted_lite_file(args.layers, args.experts, converter, args.llama_cpp_python)
    llm = LLM(str(path), max_model_len=1024, max_num_seqs=8, activations=args.activations)
    single = [[(17 * i + 3) % 8000 + 10 for i in range(32)]]
    batch = [[(17 * i + 29 * b) % 8000 + 10 for i in range(32)] for b in range(1, 5)]
    cfg = llm.engine.model_config
    ours = {
        "batch1_tok_s": rate(llm, single, args.new_tokens, args.rounds),
        "batch4_tok_s": rate(llm, batch, args.new_tokens, args.rounds),
    }
    del llm
    prompt = [(17 * i + 3) % 8000 + 10 for i in range(args.prompt_tokens)]
    ours["prompt_tok_s"] = prompt_rate(path, prompt, args.rounds, args.activations)
    mla = kv_bytes_per_block(cfg, 16, torch.bfloat16) // 16
    mha = 2 * cfg.num_layers * cfg.num_heads * cfg.layers[0].attention.mla.v_head_dim * 2
    row = {
        "bench": "mla",
        "model": f"deepseek-v2-lite-shaped/{args.layers}L/{args.experts}E-top{min(6, args.experts)}"
        f"/vocab{cfg.vocab_size}-Q4_K_M",
        "file": llama_convert.CONVERTED if converter else llama_convert.OURS,
        "routed_experts": f"{args.experts} of V2-Lite's 64 (file size); every other width V2-Lite's",
        "gib": round(path.stat().st_size / 2**30, 2),
        "device": "cpu",
        "threads": torch.get_num_threads(),
        "new_tokens": args.new_tokens,
        "prompt_tokens": args.prompt_tokens,
        "rounds": args.rounds,
        "activations": args.activations,
        **{k: round(v, 2) for k, v in ours.items()},
        "kv_bytes_per_token_bf16": mla,
        "mha_same_width_kv_bytes_per_token_bf16": mha,
    }
    row["peer"] = peer(path, prompt, single + batch, args)
    if "prompt_tokens_per_s" in row["peer"]:
        theirs = row["peer"]
        row["prompt_vs_llama_cpp"] = round(ours["prompt_tok_s"] / theirs["prompt_tokens_per_s"], 2)
        row["batch1_vs_llama_cpp"] = round(ours["batch1_tok_s"] / theirs["decode_tokens_per_s_batch1"], 2)
        row["batch4_vs_llama_cpp"] = round(
            ours["batch4_tok_s"] / theirs["decode_tokens_per_s_batch4_one_at_a_time"], 2
        )
    print(json.dumps(row), flush=True)


def peer(path: Path, prompt: list[int], short: list[list[int]], args) -> dict | str:
    """llama.cpp's rates on the file (bench/hybrid.py's peer runs), or why there are none."""
    from hybrid import llama_cpp  # bench/, beside this script

    if not args.llama_cpp_python:
        return "missing"
    # its loader: is_lite = (n_layer == 27); any other deepseek2 file must carry q_lora_rank
    if args.layers != 27:
        return {"skipped": "llama.cpp reads deepseek2 without q_lora_rank only at V2-Lite's 27 layers"}
    try:
        return llama_cpp(path, prompt, short[1:], args.new_tokens, args.llama_cpp_python)
    except SystemExit as e:  # the peer's last line of stderr
        return {"failed": str(e)}


if __name__ == "__main__":
    main()
