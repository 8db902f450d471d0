"""The GPU benchmark: real model shapes with random weights, nothing downloaded, under 8 minutes on an H200.

One JSON line per figure, in groups (--figures), the most telling first:
- q4k: batch-1 decode of a Mixtral-8x7B-like MoE with Q4_K weights (random blocks) through the quantized Triton
  kernels: tokens/s and the fraction of HBM bandwidth reached (weight bytes read per token over the time per
  token, against a measured device-to-device copy);
- kernels: the quantized decode products (GB/s per BLOCK_N, block-wise and per-weight) and an MoE layer's step;
- offload: the Q4_K model on an RTX 4090's 24 GiB, experts that do not fit in host memory: tokens/s, PCIe bytes;
  offload_cpu: the same with those experts computed by the CPU where they are (moe_cpu_compute);
- float: the same decode figure for Qwen3-0.6B-like, Mixtral-8x7B-like and Qwen3-30B-A3B-like bf16 models, and
  throughput with 256 concurrent sequences, input and output lengths random in 100-1024;
- moe: the fused MoE kernel vs the torch reference and transformers' MoE block (and its tile shapes at 4,096);
- speculative: the target as its own draft at batch 1 and 64 (and 64 in fp32): speed-up and identical output.

python bench/device.py            (on the GPU machine)
python bench/device.py --smoke    (tiny shapes on the CPU: checks that the script runs)
python bench/device.py --figures q4k,kernels   (some groups only, in that order)
"""

import argparse
import gc
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from backend import LLM, SamplingParams  # noqa: E402
from bench.device_kernels import moe_kernels, quant_gemv, sync  # noqa: E402
from bench.device_offload import offload_figure  # noqa: E402

SHAPES = {
    "qwen3-0.6b-like": dict(architectures=["Qwen3ForCausalLM"], vocab_size=151936, hidden_size=1024,
                            intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                            num_key_value_heads=8, head_dim=128, tie_word_embeddings=True,
                            max_position_embeddings=40960, rope_theta=1000000.0),
    "mixtral-8x7b-like": dict(architectures=["MixtralForCausalLM"], vocab_size=32000, hidden_size=4096,
                              intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                              num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2,
                              max_position_embeddings=32768, rope_theta=1000000.0),
    "qwen3-30b-a3b-like": dict(architectures=["Qwen3MoeForCausalLM"], vocab_size=151936, hidden_size=2048,
                               intermediate_size=6144, moe_intermediate_size=768, num_hidden_layers=48,
                               num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
                               num_experts_per_tok=8, norm_topk_prob=True, max_position_embeddings=40960,
                               rope_theta=1000000.0),
}
SMOKE = {  # the same families, tiny, for the CPU
    "qwen3-0.6b-like": dict(SHAPES["qwen3-0.6b-like"], vocab_size=512, hidden_size=64, intermediate_size=128,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16),
    "mixtral-8x7b-like": dict(SHAPES["mixtral-8x7b-like"], vocab_size=512, hidden_size=64, intermediate_size=96,
                              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2),
    "qwen3-30b-a3b-like": dict(SHAPES["qwen3-30b-a3b-like"], vocab_size=512, hidden_size=64, intermediate_size=96,
                               moe_intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                               num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2),
}


def emit(**row) -> None:
    print(json.dumps({"bench": "device", **row}), flush=True)


# Q4_K rows hold whole blocks of 256 weights: the smoke shape of the quantized figure is a little larger.
SMOKE_Q4_K = dict(SMOKE["mixtral-8x7b-like"], hidden_size=256, intermediate_size=256)


def model_dir(root: Path, name: str, shape: dict, weights: bool | str = True) -> str:
    """weights: True for random floats, or a GGUF format name for random blocks of it."""
    path = root / name
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({**shape, "scriptorium_random_weights": weights}))
    return str(path)


def copy_bandwidth(device: str, smoke: bool) -> float:
    """Bytes per second of a device-to-device copy (read plus write), the ceiling decode can approach."""
    n = (1 << 20) if smoke else (2 << 30)
    src = torch.empty(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    sync(device)
    start = time.perf_counter()
    for _ in range(10):
        dst.copy_(src)
    sync(device)
    return 2 * n * 10 / (time.perf_counter() - start)


def bytes_per_token(llm: LLM) -> int:
    """Weight bytes one decode token reads: what the model holds (quantized weights as their blocks), except the
    experts it is not routed to and, when the output layer has its own matrix, the embedding table (one row)."""
    from backend.models.moe import SparseMoE
    from backend.quant.weight_sizes import module_bytes

    model = llm.engine.model
    total = module_bytes(model)
    for m in model.modules():
        if isinstance(m, SparseMoE):
            if m.experts is not None:
                experts, count = m.experts.nbytes(), m.experts.num_experts
            else:
                experts = sum(p.numel() * p.element_size() for p in (m.w_gate_up, m.w_down))
                count = m.w_gate_up.shape[0]
            total -= experts * (1 - m.top_k / count)
    if not model.config.tie_word_embeddings:
        table = model.model.embed_tokens.weight.data  # a Parameter's tensor, or a QuantWeight's blocks
        total -= table.numel() * table.element_size()
    return int(total)


def decode_figure(llm: LLM, name: str, bandwidth: float, smoke: bool, **extra) -> dict:
    tps = decode_speed(llm, 8 if smoke else 128)
    per_token = bytes_per_token(llm)
    return {"figure": "decode_batch1", "model": name, **extra, "tok_s": round(tps, 1),
            "weight_bytes_per_token": per_token, "hbm_fraction": round(per_token * tps / bandwidth, 3),
            "kv_blocks": llm.engine.num_kv_blocks}


def decode_speed(llm: LLM, new_tokens: int) -> float:
    """Decode tokens/s at batch 1: a prompt and its first token, then the same with new_tokens more; the better of
    two each. Both runs are warmed first (the one-token run meets a cached prefix, a shape of its own)."""
    prompt = [[random.randrange(500) for _ in range(32)]]
    first = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    full = SamplingParams(temperature=0, max_tokens=new_tokens + 1, ignore_eos=True)

    def timed(params: SamplingParams) -> float:
        start = time.perf_counter()
        llm.generate(prompt, params, use_tqdm=False)  # returns once the tokens are on the host
        return time.perf_counter() - start

    timed(full)
    timed(first)
    t_first = min(timed(first) for _ in range(2))
    t_full = min(timed(full) for _ in range(2))
    return new_tokens / max(t_full - t_first, 1e-9)


def throughput(llm: LLM, sequences: int, low: int, high: int, vocab: int) -> dict:
    rng = random.Random(0)
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(low, high))] for _ in range(sequences)]
    params = [SamplingParams(temperature=0, max_tokens=rng.randint(low, high), ignore_eos=True) for _ in prompts]
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    generated = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"sequences": sequences, "generated_tokens": generated, "seconds": round(elapsed, 2),
            "tok_s": round(generated / elapsed, 1)}


def speculative(path: str, device: str, dtype: str, batch: int, new_tokens: int, smoke: bool) -> dict:
    common = dict(device=device, dtype=dtype, max_num_seqs=max(batch, 8), max_model_len=2048)
    prompts = [[random.randrange(500) for _ in range(64)] for _ in range(batch)]
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    plain = LLM(path, **common)
    plain.generate(prompts[:1], SamplingParams(max_tokens=4), use_tqdm=False)
    start = time.perf_counter()
    expected = plain.generate(prompts, params, use_tqdm=False)
    t_plain = time.perf_counter() - start
    del plain
    gc.collect()
    spec = LLM(path, speculative={"method": "draft", "model": path, "num_tokens": 4, "max_batch_size": 10**6},
               **common)
    spec.generate(prompts[:1], SamplingParams(max_tokens=4), use_tqdm=False)
    start = time.perf_counter()
    got = spec.generate(prompts, params, use_tqdm=False)
    t_spec = time.perf_counter() - start
    stats = spec.engine.stats()
    same = [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in expected]
    # forward passes by a CUDA graph, of the target's and the draft's: only prompts should run eagerly
    replayed = {name: round(r.steps["graph"] / max(sum(r.steps.values()), 1), 3)
                for name, r in (("target", spec.engine.runner), ("draft", spec.engine.proposer.runner))}
    del spec
    gc.collect()
    return {"figure": "speculative_self_draft", "batch": batch, "dtype": dtype, "plain_s": round(t_plain, 2),
            "speculative_s": round(t_spec, 2), "speedup": round(t_plain / t_spec, 3),
            "identical": same, "acceptance_rate": round(stats["spec_accepted_tokens"] /
                                                        max(stats["spec_draft_tokens"], 1), 3),
            "steps_replayed": replayed}


def free(device: str) -> None:
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


GROUPS = ("q4k", "kernels", "offload", "offload_cpu", "float", "moe", "speculative")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU")
    parser.add_argument("--figures", default=",".join(GROUPS),
                        help=f"the groups to run, in this order: a comma-separated part of {','.join(GROUPS)}")
    args = parser.parse_args()
    groups = args.figures.split(",")
    if not set(groups) <= set(GROUPS):
        sys.exit(f"--figures takes groups among {', '.join(GROUPS)}; got {args.figures}")
    smoke = args.smoke
    device = "cpu" if smoke else "cuda"
    if not smoke and not torch.cuda.is_available():
        sys.exit("bench/device.py needs a CUDA GPU (use --smoke on the CPU)")
    random.seed(0)
    torch.manual_seed(0)
    started = time.perf_counter()
    bandwidth = copy_bandwidth(device, smoke)
    emit(figure="copy_bandwidth", gb_s=round(bandwidth / 1e9, 1),
         device=torch.cuda.get_device_name() if device == "cuda" else "cpu")
    with tempfile.TemporaryDirectory() as tmp:
        for group in groups:
            for row in run_group(group, Path(tmp), device, smoke, bandwidth):
                emit(**row)
            free(device)
    emit(figure="total", seconds=round(time.perf_counter() - started, 1))


def run_group(group: str, root: Path, device: str, smoke: bool, bandwidth: float):
    """One group's figures, as they come (a figure printed before the next one starts)."""
    dtype, torch_dtype = ("float32", torch.float32) if smoke else ("bfloat16", torch.bfloat16)
    shapes = SMOKE if smoke else SHAPES
    sizes = dict(max_model_len=4096 if not smoke else 256, max_num_batched_tokens=8192 if not smoke else 256)
    mixtral_q4k = SMOKE_Q4_K if smoke else SHAPES["mixtral-8x7b-like"]
    if group == "q4k":  # Mixtral-8x7B at Q4_K: ~25 GB of blocks where bf16 needs 93 GB; a token reads the blocks
        llm = LLM(model_dir(root, "mixtral-8x7b-like-q4_k", mixtral_q4k, "Q4_K"), device=device, dtype=dtype,
                  max_num_seqs=8, **sizes)
        yield decode_figure(llm, "mixtral-8x7b-like", bandwidth, smoke, weights="Q4_K")
    elif group == "kernels":
        yield from quant_gemv(device, torch_dtype, smoke, mixtral_q4k)
    elif group in ("offload", "offload_cpu"):  # the same on an RTX 4090's budget: 24 GiB, experts that do not
        # fit in host memory, copied in when routed to or (offload_cpu) computed there
        llm = LLM(model_dir(root, "mixtral-8x7b-like-q4_k", mixtral_q4k, "Q4_K"), device=device, dtype=dtype,
                  max_num_seqs=8, moe_gpu_experts=2 if smoke else "auto", moe_cpu_compute=group == "offload_cpu",
                  gpu_memory_utilization=0.9 if smoke else 24 * 2**30, **sizes)
        yield offload_figure(llm, "mixtral-8x7b-like", smoke)
    elif group == "float":
        for name, shape in shapes.items():
            # Only the dense model runs the 256-sequence figure; the others need no graphs past batch 8.
            seqs = 256 if name == "qwen3-0.6b-like" and not smoke else 8
            llm = LLM(model_dir(root, name, shape), device=device, dtype=dtype, max_num_seqs=seqs, **sizes)
            yield decode_figure(llm, name, bandwidth, smoke)
            if name == "qwen3-0.6b-like":
                low, high = (4, 16) if smoke else (100, 1024)
                yield {"figure": "throughput", "model": name,
                       **throughput(llm, 8 if smoke else 256, low, high, shape["vocab_size"])}
            del llm
            free(device)
    elif group == "moe":
        yield from moe_kernels(device, torch_dtype, smoke, shapes["mixtral-8x7b-like"])
    else:
        dense = model_dir(root, "qwen3-0.6b-like", shapes["qwen3-0.6b-like"])
        for batch in ((1, 2) if smoke else (1, 64)):
            yield speculative(dense, device, dtype, batch, 8 if smoke else 128, smoke)
            free(device)
        if not smoke:  # whether a batch's difference from plain decoding is bf16's rounding (then fp32 agrees)
            yield speculative(dense, device, "float32", 64, 64, smoke)


if __name__ == "__main__":
    main()
