"""bench/engine_vs_peers.py --quantized: SmolLM2's Q4_1 file and a Q8_0 conversion of it, our quantized path (fp32 and int8
activations) vs our fp32 path vs transformers fp32, and llama.cpp given --llama-cpp-python (its own venv)."""

import statistics
from pathlib import Path

import numpy as np
import torch
from engine_vs_peers import best, decode_split, hf_generate, make_prompt, ours_generate
from run_peer import run_peer

from backend import LLM
from backend.model_store import pull


def q8_0_copy(path: Path) -> Path:
    """The same model with every quantized tensor requantized to Q8_0 (metadata copied), cached."""
    import gguf
    from gguf.quants import dequantize, quantize

    from backend.home import cache_dir

    q8 = gguf.GGMLQuantizationType.Q8_0

    def tensor(_: int, t) -> tuple[np.ndarray, object]:
        if t.tensor_type in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
            return np.asarray(t.data), None
        return quantize(dequantize(t.data, t.tensor_type), q8), q8

    out = cache_dir() / "bench" / path.name.replace("Q4_1", "Q8_0")
    return rewritten_gguf(path, out, gguf.LlamaFileType.MOSTLY_Q8_0, tensor)


def rewritten_gguf(source: Path, out: Path, file_type, tensor) -> Path:
    """source's metadata with file_type, and each of its tensors as tensor(index, reader tensor) gives it (its data,
    and its GGML type for raw blocks, else None), written to out whole; an existing out is taken as it is."""
    import gguf

    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    reader = gguf.GGUFReader(str(source))
    writer = gguf.GGUFWriter(str(out) + ".partial", reader.fields["general.architecture"].contents())
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key in ("general.architecture", "general.file_type"):
            continue
        sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), field.types[0], sub)
    writer.add_file_type(file_type)
    for i, t in enumerate(reader.tensors):
        data, raw_dtype = tensor(i, t)
        writer.add_tensor(t.name, data, raw_dtype=raw_dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    Path(str(out) + ".partial").replace(out)
    return out


def llama_cpp_rates(path: Path, prompts: list[list[int]], new_tokens: int,
                    python: str | None) -> tuple[float | None, float | None]:
    """llama.cpp on the same file, run by llama-cpp-python in its own venv (bench/llama_cpp_peer.py); None
    without one."""
    if not python:
        return None, None
    job = {"model": str(path), "prompts": prompts, "new_tokens": new_tokens, "threads": torch.get_num_threads()}
    rates = run_peer("llama_cpp_peer.py", job, python)
    return rates["single_tok_s"], rates["batch_tok_s"]


def quantized_rows(args) -> dict:
    """Our quantized path vs our fp32 path vs transformers fp32 (vs llama.cpp), batch 1 and concurrent."""
    from transformers import AutoModelForCausalLM

    q4 = pull("smollm2", quiet=True)
    row: dict = {"bench": "engine-quantized", "model": "smollm2-135m", "device": "cpu",
                 "threads": torch.get_num_threads(), "new_tokens": args.new_tokens, "batch": args.concurrency}
    for label, path in (("q4_1", q4), ("q8_0", q8_0_copy(q4))):
        ours = LLM(str(path), max_num_seqs=max(64, args.concurrency))
        tokenizer = ours.tokenizer
        single = [make_prompt(tokenizer, 32, 0)]
        batch = [make_prompt(tokenizer, 32, salt) for salt in range(1, args.concurrency + 1)]
        total = args.new_tokens * args.concurrency
        rates = {}
        for name, settings in (("quantized", None), ("int8", {"activations": "int8"}),
                               ("fp32", {"quantization": "dequantize"})):
            llm = ours if settings is None else LLM(str(path), max_num_seqs=max(64, args.concurrency), **settings)
            ours_generate(llm, single, 8)
            rates[name] = (args.new_tokens / best(ours_generate, llm, single, args.new_tokens),
                           total / best(ours_generate, llm, batch, args.new_tokens))
            del llm
        hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        hf_generate(hf, single, 8, pad)
        rates["transformers"] = (args.new_tokens / best(hf_generate, hf, single, args.new_tokens, pad),
                                 total / best(hf_generate, hf, batch, args.new_tokens, pad))
        rates["llama_cpp"] = llama_cpp_rates(path, [single[0]] + batch, args.new_tokens, args.llama_cpp_python)
        for name, (one, many) in rates.items():
            row[f"{label}_{name}_single_tok_s"] = None if one is None else round(one, 2)
            row[f"{label}_{name}_batch_tok_s"] = None if many is None else round(many, 2)
        q, t = rates["quantized"], rates["transformers"]
        row[f"{label}_single_vs_transformers"] = round(q[0] / t[0], 2)
        row[f"{label}_batch_vs_transformers"] = round(q[1] / t[1], 2)
        row[f"{label}_single_vs_fp32"] = round(q[0] / rates["fp32"][0], 2)
        row[f"{label}_decode_step_split"] = decode_split(ours, single[0], 1000 / q[0])
        if rates["llama_cpp"][0] is not None:
            for name in ("quantized", "int8"):
                row[f"{label}_{name}_single_vs_llama_cpp"] = round(rates[name][0] / rates["llama_cpp"][0], 2)
    return row


def moe_rows(args) -> list[dict]:
    """One row per MoE file (bench/moe_gguf.py: Qwen3-MoE and Mixtral shapes, Q4_K_M, llama.cpp's layout): our
    decode at batch 1 and 4, exact and int8 activations, beside llama.cpp's on the same file (null without it).
    The three are measured in turn, args.rounds times, and each keeps its median: a VM whose speed drifts by a
    quarter between runs then moves all three alike."""
    from moe_gguf import DEFAULT_SHAPES, moe_file  # bench/, beside this script

    rows = []
    for family in args.shapes.split(",") if args.shapes else DEFAULT_SHAPES:
        path = moe_file(family)
        single = [[(17 * i + 3) % 400 + 3 for i in range(32)]]
        batch = [[(17 * i + 29 * b) % 400 + 3 for i in range(32)] for b in range(1, args.concurrency + 1)]
        row: dict = {"bench": "engine-quantized-moe", "model": f"{family}-Q4_K_M", "device": "cpu",
                     "threads": torch.get_num_threads(), "new_tokens": args.new_tokens, "batch": args.concurrency,
                     "rounds": args.rounds}
        engines = {name: LLM(str(path), max_num_seqs=max(8, args.concurrency), max_model_len=512, **settings)
                   for name, settings in (("exact", {}), ("int8", {"activations": "int8"}))}
        for llm in engines.values():
            ours_generate(llm, single, 8)
        measured: dict[str, list] = {name: [] for name in (*engines, "llama_cpp")}
        for _ in range(args.rounds):
            for name, llm in engines.items():
                measured[name].append((args.new_tokens / best(ours_generate, llm, single, args.new_tokens),
                                       args.new_tokens * len(batch) / best(ours_generate, llm, batch, args.new_tokens)))
            measured["llama_cpp"].append(llama_cpp_rates(path, single + batch, args.new_tokens, args.llama_cpp_python))
        del engines
        rates = {name: tuple(None if None in runs else statistics.median(runs) for runs in zip(*values))
                 for name, values in measured.items()}
        for name, (one, many) in rates.items():
            row[f"{name}_single_tok_s"] = None if one is None else round(one, 2)
            row[f"{name}_batch_tok_s"] = None if many is None else round(many, 2)
        if rates["llama_cpp"][0] is not None:
            for name in ("exact", "int8"):
                row[f"{name}_single_vs_llama_cpp"] = round(rates[name][0] / rates["llama_cpp"][0], 2)
                row[f"{name}_batch_vs_llama_cpp"] = round(rates[name][1] / rates["llama_cpp"][1], 2)
        rows.append(row)
    return rows
