"""Hybrid linear attention on the CPU, ours beside llama.cpp on the same file: a Qwen3.5-35B-A3B-shaped Q4_K_M GGUF
of random weights (transformers' Qwen3_5MoeForCausalLM: three Gated DeltaNet layers to one gated full-attention
layer, the 35B's widths), cut to fewer layers, experts and a smaller vocabulary so that it builds on a small machine
(the row says which), written in llama.cpp's qwen35moe layout by the tests' copy of its converter
(tests/backend/tiny_gguf_qwen3_next.py; tiny files of it decode to llama.cpp's own greedy tokens). Q4_K_M as
llama.cpp's quantizer picks it (bench/cut_checkpoint.py): Q4_K, Q6_K for ffn_down(_exps/_shexp), attn_v and the output.

One JSON line: prompt tokens/s and decode at batch 1 and 4, ours ("ours": exact, fp32 activations; "ours_int8":
activations quantized per group to 8 bits, as llama.cpp multiplies on the CPU) and llama.cpp's (llama-cpp-python, a benchmark peer
in a venv of its own: --llama-cpp-python PATH or LLAMA_CPP_PYTHON; it serves one sequence at a time, so its batch-4
figure is four sequences one after another), the state bytes a sequence (this model's and the full 35B's), and one
linear layer's recurrent update at batch 1 (our C kernel against the torch step).

With --llama-cpp-converter PATH (or LLAMA_CPP_CONVERTER) the file is written as a user writes it instead: the same
random checkpoint through llama.cpp's convert_hf_to_gguf.py and its quantizer's Q4_K_M (bench/llama_cpp_convert.py),
with the 151,936 tokens of llama.cpp's qwen35 vocabulary file at least (the converter accepts only a tokenizer it
knows); the row's "file" says which writer made it.

Run: python bench/hybrid.py [--layers 8 --experts 16 --prompt 256 --tokens 16] [--llama-cpp-converter PATH]
"""

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from backend import LLM, SamplingParams  # noqa: E402
from backend.engine.state_pool import state_bytes_per_sequence  # noqa: E402
from backend.hf_config import from_hf_config  # noqa: E402
from backend.kernels import delta_rule, native  # noqa: E402
from bench import cut_checkpoint as cut  # noqa: E402
from bench import llama_cpp_convert as llama_convert  # noqa: E402

# Qwen3.5-35B-A3B's text model, with a context this bench's runs fit in
QWEN35_35B = dict(cut.PUBLISHED["qwen3.5-35b-a3b"], max_position_embeddings=4096)
# the Gated DeltaNet layers' own kinds
LINEAR_ATTENTION = ("attn_qkv", "attn_gate", "ssm_beta", "ssm_alpha", "ssm_out")
Q4_K_M = cut.q4_k_m(*cut.ENDS, *cut.ATTENTION, *LINEAR_ATTENTION, *cut.EXPERTS, *cut.SHARED_EXPERT)


def _shape(layers: int, experts: int, vocab: int) -> dict:
    return {**QWEN35_35B, "num_hidden_layers": layers, "num_experts": experts, "vocab_size": vocab}


def _checkpoint(directory: Path, shape: dict) -> None:
    """A random Qwen3_5MoeForCausalLM of this shape, saved in bf16."""
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    # the interleaved MRoPE sections of the 35B's config (one position for text: plain rotary either way)
    rope = {
        "rope_type": "default",
        "rope_theta": 10000000.0,
        "partial_rotary_factor": 0.25,
        "mrope_section": [11, 11, 10],
        "mrope_interleaved": True,
    }
    config = Qwen3_5MoeTextConfig(
        **shape,
        rope_parameters=rope,
        initializer_range=0.02,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    cut.random_bf16_checkpoint(Qwen3_5MoeForCausalLM, config, directory)


def build(layers: int, experts: int, vocab: int) -> tuple[Path, dict]:
    """The cached Q4_K_M file of this shape (written on first use, under the data directory's cache/bench)."""
    from tests.backend.tiny_gguf_qwen3_next import convert

    shape = _shape(layers, experts, vocab)

    def write(scratch: Path, partial: Path) -> None:
        _checkpoint(scratch / "hf", shape)
        convert(scratch / "hf", partial, Q4_K_M, reference=False)

    return cut.cached_gguf(f"qwen35moe-{cut.shape_key(shape, Q4_K_M)}-Q4_K_M.gguf", write), shape


def build_converted(
    layers: int, experts: int, vocab: int, converter: Path, python: str | None
) -> tuple[Path, dict]:
    """The same checkpoint (with llama.cpp's qwen35 vocabulary at least) through its converter and quantizer,
    cached."""
    shape = _shape(layers, experts, max(vocab, llama_convert.VOCABULARIES["qwen35"]))
    name = f"qwen35moe-{cut.shape_key(shape)}-llama.cpp-Q4_K_M.gguf"
    # transformers saves no multi-token-prediction layer, which the converter expects of Qwen3.5 unless told
    flags = ("--no-mtp",)
    return llama_convert.converted_gguf(
        name, lambda hf: _checkpoint(hf, shape), "Q4_K_M", converter, python, "qwen35", flags
    ), shape


def rate(llm: LLM, prompts: list[list[int]], tokens: int) -> float:
    """Generated tokens a second, all prompts together (their prefill timed apart and taken out)."""
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    started = time.perf_counter()
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True), use_tqdm=False)
    prefill = time.perf_counter() - started
    started = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    return len(prompts) * (tokens - 1) / (time.perf_counter() - started - prefill)


# ours in each activations mode: exact (fp32 activations) and int8 (x quantized per group to 8 bits, as llama.cpp
# multiplies on the CPU: the like-for-like mode)
MODES = {"exact": {}, "int8": {"activations": "int8"}}


def ours(path: Path, prompt: list[int], short: list[list[int]], args, **engine) -> tuple[dict, object]:
    """Our prompt and decode rates on the file with these engine settings, and the model's config (the engine is let
    go before the next mode's loads)."""
    llm = LLM(
        str(path), max_num_seqs=4, max_model_len=args.prompt + args.tokens + 8, enable_prefix_caching=False, **engine
    )
    llm.generate([prompt[:16]], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)  # warm up
    started = time.perf_counter()
    llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    prompt_rate = args.prompt / (time.perf_counter() - started)
    return {
        "prompt_tokens_per_s": round(prompt_rate, 1),
        "decode_tokens_per_s_batch1": round(rate(llm, short[:1], args.tokens), 2),
        "decode_tokens_per_s_batch4": round(rate(llm, short, args.tokens), 2),
    }, llm.engine.model_config


def recurrent_update_ms(batch: int = 1) -> dict:
    """One 35B-shaped linear layer's recurrent update of `batch` rows on a pool of 8 slots: the least of 20 runs."""
    hk, hv, dk, dv = 16, 32, 128, 128
    q, k, v = torch.randn(batch, hk, dk), torch.randn(batch, hk, dk), torch.randn(batch, hv, dv)
    g, beta = -torch.rand(batch, hv), torch.rand(batch, hv)
    pool, slots, fresh = (
        torch.randn(8, hv, dk, dv) * 0.1,
        torch.arange(batch),
        torch.zeros(batch, dtype=torch.bool),
    )

    def torch_step():
        state = pool.index_select(0, slots)
        _, state = delta_rule.recurrent_step(q, k, v, g, beta, state)
        pool.index_copy_(0, slots, state)

    def ours():
        delta_rule.recurrent_in_pool(q, k, v, g, beta, pool, slots, fresh)

    times = {}
    for name, fn in (("torch", torch_step), ("c_kernel", ours if native.enabled() else None)):
        if fn is None:
            continue
        fn()
        best = min(_timed(fn) for _ in range(20))
        times[name] = round(best * 1e3, 3)
    return times


def _timed(fn) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def llama_cpp(path: Path, prompt: list[int], short: list[list[int]], tokens: int, python: str | None) -> dict:
    """llama.cpp's rates on the same file (bench/llama_cpp_iq_peer.py, bench/llama_cpp_peer.py), or why not."""
    if not python:
        return {"missing": "no llama-cpp-python venv (--llama-cpp-python or LLAMA_CPP_PYTHON)"}
    from run_peer import run_peer  # bench/, beside this script

    threads = torch.get_num_threads()
    rates = run_peer(
        "llama_cpp_iq_peer.py",
        {"action": "rates", "model": str(path), "prompt": prompt, "new_tokens": tokens, "threads": threads},
        python,
    )
    # its single-sequence rate (best of two) and four sequences served one after another
    served = run_peer(
        "llama_cpp_peer.py",
        {"model": str(path), "prompts": short[:1] + short, "new_tokens": tokens, "threads": threads},
        python,
    )
    return {
        "prompt_tokens_per_s": round(rates["prompt_tok_s"], 1),
        "decode_tokens_per_s_batch1": round(max(rates["decode_tok_s"], served["single_tok_s"]), 2),
        "decode_tokens_per_s_batch4_one_at_a_time": round(served["batch_tok_s"], 2),
        **{k: v for k, v in rates.items() if k == "extra_buffers"},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--prompt", type=int, default=256, help="prompt tokens for the prompt rate")
    parser.add_argument(
        "--tokens", type=int, default=16, help="tokens generated a sequence for the decode rates"
    )
    parser.add_argument("--llama-cpp-python", default=os.environ.get("LLAMA_CPP_PYTHON"))
    parser.add_argument(
        "--llama-cpp-converter", help="llama.cpp's convert_hf_to_gguf.py (or LLAMA_CPP_CONVERTER)"
    )
    args = parser.parse_args()
    converter = llama_convert.converter_from(args.llama_cpp_converter)
    if converter is None:
        path, shape = build(args.layers, args.experts, args.vocab)
    else:
        path, shape = build_converted(args.layers, args.experts, args.vocab, converter, args.llama_cpp_python)
    prompt = [(i * 37) % 397 + 3 for i in range(args.prompt)]  # within the tokenizer's 400 tokens
    short = [prompt[i : i + 16] for i in range(0, 64, 16)]
    rates, config = {}, None
    for mode, engine in MODES.items():
        rates[mode], config = ours(path, prompt, short, args, **engine)
    row = {
        "bench": "hybrid",
        "model": f"Qwen3.5-35B-A3B widths, {args.layers} layers, {args.experts} experts, "
        f"vocab {shape['vocab_size']}, random Q4_K_M GGUF (qwen35moe)",
        "file": llama_convert.CONVERTED if converter else llama_convert.OURS,
        "threads": torch.get_num_threads(),
        "ours": rates["exact"],
        "ours_int8": rates["int8"],
        "llama_cpp": llama_cpp(path, prompt, short, args.tokens, args.llama_cpp_python),
        "state_bytes_a_sequence": state_bytes_per_sequence(config),
        "state_bytes_a_sequence_35b": state_bytes_per_sequence(
            from_hf_config({**QWEN35_35B, "architectures": ["Qwen3_5MoeForCausalLM"]}, "35b")
        ),
        "recurrent_update_ms_one_layer_batch1": recurrent_update_ms(),
        "shape": {k: shape[k] for k in ("hidden_size", "num_hidden_layers", "num_experts", "vocab_size")},
    }
    print(json.dumps(row))


if __name__ == "__main__":
    main()
