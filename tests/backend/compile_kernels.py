"""Compiles every Triton kernel for a GPU target without a GPU (see test_triton_compile.py).

Run in a process of its own, without TRITON_INTERPRET: the interpreter replaces triton.language's
operators process-wide, which the compiler cannot work with.

python -m tests.backend.compile_kernels   one JSON line per (case, kernel specialisation)
"""

import json
import multiprocessing
import os
import re
from concurrent.futures import ProcessPoolExecutor

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from backend.engine.kv_budget import CUDA_BLOCK_SIZES
from backend.kernels import moe_triton as mt
from backend.kernels import quant_gemv_triton as qgt
from backend.kernels import quant_moe_triton as qmt
from backend.kernels import quant_triton as qt
from backend.kernels import triton_kernels as tk
from backend.quant.formats import BY_NAME, row_bytes

# Shared memory one block may use (CUDA programming guide, "Technical specifications per compute capability").
SHARED_LIMIT = {90: 227 * 1024, 89: 99 * 1024, 80: 163 * 1024}
TYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.int64: "i64",
         torch.int32: "i32", torch.bool: "i1", torch.uint8: "u8"}
# Real shapes: (q heads, kv heads, head dim, hidden, MoE intermediate, experts, top-k)
MODELS = {"mixtral-8x7b": (32, 8, 128, 4096, 14336, 8, 2), "qwen3-30b-a3b": (32, 4, 128, 2048, 768, 128, 8),
          "smollm2-135m": (9, 3, 64, 576, 1536, 4, 2)}


class Recorder:
    """Stands where a kernel is: `kernel[grid](*args)` records the launch instead of running it."""

    def __init__(self, kernel):
        self.kernel = kernel
        self.launches = []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launches.append((args, kwargs))


def signature(kernel, args, kwargs) -> tuple[dict, dict, dict, dict]:
    """Triton's signature, constants and attributes for a launch, specialised as its launcher does: ints equal to 1
    become constants, and pointers and ints that are multiples of 16 are marked so (the vector loads it allows are
    what runs on a device)."""
    values = dict(zip(kernel.arg_names, args)) | kwargs
    options = {k: values.pop(k) for k in ("num_warps", "num_stages") if k in values}
    sig, consts, attrs = {}, {}, {}
    for i, p in enumerate(kernel.params):
        v = values[p.name]
        if p.is_constexpr or (type(v) is int and v == 1 and not p.do_not_specialize):
            sig[p.name], consts[p.name] = "constexpr", v
            continue
        if isinstance(v, torch.Tensor):
            sig[p.name] = "*" + TYPES[v.dtype]
        elif isinstance(v, bool):
            sig[p.name] = "i1"
        elif isinstance(v, int):
            sig[p.name] = "i32" if -2**31 <= v < 2**31 else "i64"
        else:
            sig[p.name] = "fp32"
        aligned = v.data_ptr() % 16 == 0 if isinstance(v, torch.Tensor) else type(v) is int and v % 16 == 0
        if aligned and not p.do_not_specialize:
            attrs[(i,)] = [["tt.divisibility", 16]]
    return sig, consts, options, attrs


def global_loads(ptx: str) -> dict[str, int]:
    """The kernel's loads from global memory in its PTX, counted by width ("b8", "v4.b32", ...)."""
    widths = re.findall(r"ld\.global(?:\.[a-z]+)*?\.((?:v\d\.)?[busf]\d+)\s", ptx)
    return {w: widths.count(w) for w in sorted(set(widths))}


def launches(dtype, model, block_sizes=(16,)):
    """Call every wrapper as the engine does for this model and dtype (the attention kernels with a cache of
    each block size: the first one in every shape, the others in the largest); return the recorded launches."""
    hq, hkv, d, hidden, inter, experts, top_k = MODELS[model]
    recorders = {}
    modules = {"_store_kv_kernel": tk, "_decode_kernel": tk, "_prefill_kernel": tk, "_rms_norm_kernel": tk,
               "_rotary_kernel": tk, "_moe_up_kernel": mt, "_moe_down_kernel": mt}
    for name, mod in modules.items():
        recorders[name] = Recorder(getattr(mod, name))
        setattr(mod, name, recorders[name])
    bs, blocks = 16, 64
    k_cache = torch.zeros(blocks, bs, hkv, d, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    tables = torch.zeros(3, 5, dtype=torch.long)
    lens = torch.tensor([1, 40, 70])
    tk.store_kv(torch.zeros(7, hkv, d, dtype=dtype), torch.zeros(7, hkv, d, dtype=dtype), k_cache, v_cache,
                torch.arange(7))
    for window in (None, 4096):
        tk.decode_attention(torch.zeros(3, hq, d, dtype=dtype), k_cache, v_cache, tables, lens, d ** -0.5, window)
        for chunk in (30, 70):  # query tiles of 32 and 64 rows
            tk.prefill_attention(torch.zeros(chunk + 21, hq, d, dtype=dtype), k_cache, v_cache, tables,
                                 torch.tensor([0, 1, 21, chunk + 21]), lens, chunk, d ** -0.5, window)
    for size in block_sizes[1:]:
        cache = torch.zeros(2, size, hkv, d, dtype=dtype)
        tk.decode_attention(torch.zeros(3, hq, d, dtype=dtype), cache, cache, tables, lens, d ** -0.5)
        tk.prefill_attention(torch.zeros(91, hq, d, dtype=dtype), cache, cache, tables,
                             torch.tensor([0, 1, 21, 91]), lens, 70, d ** -0.5)
    x, w = torch.zeros(5, hidden, dtype=dtype), torch.ones(hidden, dtype=dtype)
    tk.rms_norm(x, w, 1e-6)
    tk.rms_norm(x, w, 1e-6, residual=x)
    tk.rms_norm(torch.zeros(5, hq, d, dtype=dtype), torch.ones(d, dtype=dtype), 1e-6)  # Qwen3's q/k norm
    tk.apply_rotary(torch.zeros(5, hq + hkv, d, dtype=dtype), torch.zeros(5, d, dtype=dtype),
                    torch.zeros(5, d, dtype=dtype))
    w_gate_up = torch.zeros(experts, 2 * inter, hidden, dtype=dtype)
    w_down = torch.zeros(experts, hidden, inter, dtype=dtype)
    for tokens in (1, 512):  # both tile configurations
        ids = torch.arange(tokens * top_k).remainder(experts).view(tokens, top_k)
        mt.fused_moe(torch.zeros(tokens, hidden, dtype=dtype), w_gate_up, w_down,
                     torch.ones(tokens, top_k, dtype=torch.float32), ids)
    for name, recorder in recorders.items():
        setattr(modules[name], name, recorder.kernel)
    return [(r.kernel, args, kwargs) for r in recorders.values() for args, kwargs in r.launches]


CASES = [(90, torch.bfloat16, "mixtral-8x7b"), (90, torch.float16, "qwen3-30b-a3b"),
         (90, torch.float32, "smollm2-135m"), (89, torch.bfloat16, "qwen3-30b-a3b"),
         (89, torch.float16, "mixtral-8x7b"), (89, torch.float32, "smollm2-135m"), (80, torch.bfloat16, "mixtral-8x7b")]
# GGUF formats per case (the quantized linear kernels) and (gate, up, down) of the quantized MoE: every format
# on sm_90 and on sm_89, split across their cases to bound the compile time; K-quants and the 256-block codebooks
# only where the model's rows hold whole 256-blocks (SmolLM2's 576 does not).
CODEBOOKS_A = ("IQ4_XS", "IQ3_XXS", "IQ3_S", "IQ2_XXS", "IQ2_XS")
CODEBOOKS_B = ("IQ2_S", "IQ1_S", "IQ1_M", "TQ1_0", "TQ2_0")
QUANT = [(("Q4_K", "Q5_K", "Q6_K", "Q8_0", *CODEBOOKS_A), ("Q4_K", "Q4_K", "Q6_K")),
         (("Q2_K", "Q3_K", "Q4_0", *CODEBOOKS_B), ("IQ3_XXS", "Q2_K", "IQ2_S")),
         (("Q4_1", "Q5_0", "Q5_1", "IQ4_NL", "MXFP4"), ("Q8_0", "Q5_0", "Q4_1")),
         (("Q4_K", "Q5_K", "Q6_K", "Q2_K", *CODEBOOKS_A), ("Q5_K", "Q4_K", "Q6_K")),
         (("Q3_K", "Q8_0", "Q4_0", *CODEBOOKS_B), ("IQ1_M", "Q8_0", "Q4_0")),
         (("Q4_1", "Q5_0", "Q5_1", "IQ4_NL", "MXFP4"), ("MXFP4", "Q5_1", "Q8_0")),
         (("Q4_K", "Q8_0"), ("Q4_K", "Q4_K", "Q6_K"))]
QUANT_KERNELS = ("_qgemv_kernel", "_qgemm_kernel", "_qmoe_up_kernel", "_qmoe_down_kernel", "_block_gemv_kernel",
                 "_block_gemm_kernel", "_block_moe_up_kernel", "_block_moe_down_kernel")


def quant_launches(dtype, model, formats, moe_formats):
    """The quantized linear layer (decode- and prefill-shaped) and MoE wrappers, recorded."""
    _, _, _, hidden, inter, experts, top_k = MODELS[model]
    modules = {"_qgemv_kernel": qt, "_qgemm_kernel": qt, "_qmoe_up_kernel": qmt, "_qmoe_down_kernel": qmt,
               "_block_gemv_kernel": qgt, "_block_gemm_kernel": qgt, "_block_moe_up_kernel": qmt,
               "_block_moe_down_kernel": qmt}
    recorders = {name: Recorder(getattr(mod, name)) for name, mod in modules.items()}
    for name, mod in modules.items():
        setattr(mod, name, recorders[name])

    def blocks(name, rows, cols, lead=()):
        return torch.zeros(*lead, rows, row_bytes(BY_NAME[name], cols), dtype=torch.uint8)

    for name in formats:
        fmt = BY_NAME[name]
        for m in (1, 9, 40, 100):  # decode-shaped, batches (both tiles of the block-wise product), a chunk
            qt.qlinear(torch.zeros(m, hidden, dtype=dtype), blocks(name, 1024, hidden), fmt.ggml_type, 1024, hidden,
                       row_bytes(fmt, hidden))
    g, u, d = (BY_NAME[n] for n in moe_formats)
    stacks = [(blocks(g.name, inter, hidden, (experts,)), g.ggml_type, row_bytes(g, hidden)),
              (blocks(u.name, inter, hidden, (experts,)), u.ggml_type, row_bytes(u, hidden)),
              (blocks(d.name, hidden, inter, (experts,)), d.ggml_type, row_bytes(d, inter))]
    for tokens in (1, 512):  # both tile configurations of the grouped kernels
        ids = torch.arange(tokens * top_k).remainder(experts).view(tokens, top_k)
        qmt.fused_moe(torch.zeros(tokens, hidden, dtype=dtype), *stacks, torch.ones(tokens, top_k), ids,
                      tiles=mt.moe_tiles(tokens * top_k, experts))
    # The block-wise decode kernels, on these formats where they read them all, else on 32-blocks (any model's rows).
    if not {g.ggml_type, u.ggml_type, d.ggml_type} <= set(qgt.BLOCK_FORMATS):
        g, u, d = BY_NAME["Q8_0"], BY_NAME["Q4_1"], BY_NAME["Q4_0"]
    stacks = [(blocks(g.name, inter, hidden, (experts,)), g.ggml_type, row_bytes(g, hidden)),
              (blocks(u.name, inter, hidden, (experts,)), u.ggml_type, row_bytes(u, hidden)),
              (blocks(d.name, hidden, inter, (experts,)), d.ggml_type, row_bytes(d, inter))]
    ids = torch.arange(top_k).view(1, top_k)
    qmt.moe_gemv(torch.zeros(1, hidden, dtype=dtype), *stacks, torch.ones(1, top_k), ids)
    ids = torch.arange(512 * top_k).remainder(experts).view(512, top_k)  # the grouped kernels' block-wise tiles
    qmt.fused_moe(torch.zeros(512, hidden, dtype=dtype), *stacks, torch.ones(512, top_k), ids)
    for name, mod in modules.items():
        setattr(mod, name, recorders[name].kernel)
    return [(r.kernel, args, kwargs) for r in recorders.values() for args, kwargs in r.launches]




def case_rows(index: int, sizes: tuple) -> list[dict]:
    """The rows of case `index` (CASES, QUANT): every kernel specialisation its launches make, compiled for its card,
    the attention kernels for each block size in `sizes`."""
    (capability, dtype, model), (formats, moe_formats) = CASES[index], QUANT[index]
    case = f"sm_{capability}-{TYPES[dtype]}-{model}"
    seen, rows = set(), []
    for kernel, args, kwargs in launches(dtype, model, sizes) + quant_launches(dtype, model, formats, moe_formats):
        sig, consts, options, attrs = signature(kernel, args, kwargs)
        key = (kernel.fn.__name__, tuple(sorted(sig.items())), tuple(sorted(consts.items())), str(sorted(attrs)))
        if key in seen:
            continue
        seen.add(key)
        row = {"case": case, "kernel": kernel.fn.__name__, "constants": {k: str(v) for k, v in consts.items()},
               "capability": capability}
        try:
            binary = triton.compile(ASTSource(fn=kernel, signature=sig, constexprs=consts, attrs=attrs),
                                    target=GPUTarget("cuda", capability, 32), options=options or None)
            row.update(cubin_bytes=len(binary.asm["cubin"]), shared=binary.metadata.shared,
                       shared_limit=SHARED_LIMIT[capability], loads=global_loads(binary.asm["ptx"]))
        except Exception as e:  # reported, the test names the kernel and the case
            row["error"] = f"{type(e).__name__}: {e}"[-3000:]
        rows.append(row)
    return rows


def main() -> None:
    assert os.environ.get("TRITON_INTERPRET") != "1", "run without TRITON_INTERPRET"
    # Every block size the engine accepts on CUDA, once per card (the first case of each).
    sizes, capabilities = [], set()
    for capability, _, _ in CASES:
        sizes.append((16,) if capability in capabilities else CUDA_BLOCK_SIZES)
        capabilities.add(capability)
    # The cases compile side by side, a process a core: Triton's passes and ptxas run on one thread, and the cold
    # compile took 6 minutes one case after another on 2 cores. Spawned, not forked: torch's threads are running.
    workers = min(len(CASES), os.cpu_count() or 1)
    with ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        for rows in pool.map(case_rows, range(len(CASES)), sizes):
            for row in rows:
                print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
