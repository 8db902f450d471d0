"""Our C kernels for the CPU (backend/csrc/: every entry point and struct declared in cpu_exports.h; the quantized
matmuls behind qmm in cpu_dispatch.c: cpu_kernel.c (its 4-bit panels with AVX-512: cpu_nibbles.c), cpu_int8.c (its
blocks of 16 rows on AMX tiles: cpu_amx_int8.c), cpu_amx.c, cpu_amx_codes.c; the MoE call cpu_moe.c (its router and
shared expert's rows cpu_moe_route.c); the small ops, attention and the one-call decode step cpu_ops.c,
cpu_attention.c, cpu_decoder.c; linear attention's recurrent update cpu_delta_rule.c, and a Gated DeltaNet layer's
decode rows around it cpu_deltanet.c; an embedding's rows from the packed weights cpu_packed_rows.c; latent
attention's decode rows cpu_mla.c), built into one library.

Compiled at first use with the machine's C compiler (the one Triton needs on CUDA too) for this CPU
(-march=native; SCRIPTORIUM_CPU_MARCH names another x86 or ARM -march this CPU runs, as GCC spells it: haswell for
AVX2 alone, alderlake for AVX2 with AVX-VNNI, to run or measure another CPU's code paths here), and cached under
$SCRIPTORIUM_HOME/cache/native, keyed by the sources, the flags and the CPU.
AVX-512 or AVX2 intrinsics on x86, GCC's portable vectors elsewhere (ARM). Without a compiler library() is None
(with one warning) and every caller takes its torch reference instead; SCRIPTORIUM_CPU_KERNELS=torch asks for
that.
"""

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

from backend.home import cache_dir

log = logging.getLogger("backend")

_CSRC = Path(__file__).parent.parent / "csrc"
SOURCES = [_CSRC / f"cpu_{name}.c" for name in ("ops", "attention", "decoder", "dispatch", "kernel", "amx", "amx_codes",
                                                 "moe", "moe_route", "int8", "int8_rows", "int8_bytes", "amx_int8",
                                                 "nibbles", "delta_rule", "packed_rows", "mla", "chunk_attention",
                                                 "deltanet")]
HEADERS = sorted(_CSRC.glob("*.h"))
FLAGS = ["-O3", "-fopenmp", "-ffp-contract=off", "-Wno-psabi", "-shared", "-fPIC"]


@functools.cache
def enabled() -> bool:
    return os.environ.get("SCRIPTORIUM_CPU_KERNELS", "native") != "torch" and library() is not None


# KV cache element types our attention reads and the one-call step writes (cpu_vectors.h's KV_F32, KV_F16, KV_BF16)
KV_KINDS = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}


def usable(*tensors) -> bool:
    """Whether these tensors can go through the C kernels: fp32, on the CPU, rows contiguous (checked by callers
    where a view is fine)."""
    if not enabled():
        return False
    for t in tensors:  # noqa: SIM110 (a loop, not all() over a generator: called hundreds of times a step)
        if t.dtype != torch.float32 or not t.is_cpu:
            return False
    return True


def amx() -> bool:
    """Whether matmuls with bf16 products run on AMX tiles here (this build, this CPU, the kernel's permission)."""
    return bool(library().amx_usable())


def vnni() -> bool:
    """Whether this build's 8-bit products are AVX-512 VNNI's (an fp32 engine's quantized matmuls then take x in three
    8-bit digits, cpu_layout's "digits": faster than fp32 products, as exact)."""
    return bool(library().int8_vnni())


def tile_rows() -> int:
    """Rows of x a tile of the quantized kernel meets: 16 with AVX-512, 4 in the AVX2 and portable builds."""
    return ctypes.c_int64.in_dll(library(), "ROWS_PER_TILE").value


_building = threading.Lock()  # a second first caller waits for the one compiling, then maps its library


@functools.cache
def library() -> ctypes.CDLL | None:
    """The compiled kernel, or None (logged once) where it cannot be built here."""
    with _building:
        try:
            return load(build(os.environ.get("SCRIPTORIUM_CPU_MARCH") or "native"))
        except (OSError, RuntimeError) as e:
            log.warning("no CPU kernels: quantized layers dequantize on every matmul (slow) and the small ops run "
                        "as several PyTorch ops: %s", e)
            return None


def build_in_background() -> None:
    """Start compiling the kernels (a first start on a machine: seconds of the C compiler) while the caller reads
    the model's file; library() then waits for it rather than compiling again."""
    if os.environ.get("SCRIPTORIUM_CPU_KERNELS", "native") != "torch" and library.cache_info().currsize == 0:
        threading.Thread(target=library, name="compile-cpu-kernels", daemon=True).start()


def load(path: Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(path))
    i64, ptr, i32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    lib.qmm.argtypes = [ptr, i64, ptr, ptr, ptr, i64, i64, i32, i64, i32, i32, ptr, i64, i32]
    lib.qmm.restype = None
    lib.qmm_parts.argtypes = [ptr, i64, ptr, ptr, i64, ptr, i64, i32]
    lib.qmm_parts.restype = None
    lib.moe_tokens.argtypes = [ptr, i64, ptr, ptr, i64, i64, ptr, ptr, ptr, ptr, i32]
    lib.moe_tokens.restype = i32
    lib.moe_tokens_biased.argtypes = [ptr, i64, ptr, ptr, i64, i64, ptr, ptr, ptr, ptr, ptr, ctypes.c_float,
                                      ctypes.c_float, ptr, i32]
    lib.moe_tokens_biased.restype = i32
    lib.rows_of_packed.argtypes = [ptr, ptr, ptr, i64, i64, i64, i32, i32, i32, ptr, i64, ptr]
    lib.rows_of_packed.restype = i32
    lib.moe_route_rows.argtypes = [ptr, i64, ptr, ptr, i64, i64, i64, i32, ptr, ptr, i32]
    lib.moe_route_rows.restype = i32
    lib.moe_add_shared_rows.argtypes = [ptr, i64, ptr, i64, ptr, ptr]
    lib.moe_add_shared_rows.restype = None
    lib.rms_norm_rows.argtypes = [ptr, ptr, ptr, ptr, ptr, i64, i64, ctypes.c_float]
    lib.rotary_rows.argtypes = [ptr, ptr, i64, i64, i64, i64, ptr, ptr, i64]
    lib.silu_mul_rows.argtypes = [ptr, ptr, i64, i64]
    lib.gelu_tanh_mul_rows.argtypes = [ptr, ptr, i64, i64]
    lib.delta_rule_rows.argtypes = [ptr] * 9 + [i64] * 5 + [i32]
    lib.delta_rule_rows.restype = None
    lib.delta_rule_run.argtypes = [ptr] * 7 + [i64] * 5 + [i32]
    lib.delta_rule_run.restype = None
    lib.deltanet_rows.argtypes = [ptr, ptr, i64, ptr, i64, i64, ptr, ptr, ptr, i32]
    lib.deltanet_rows.restype = i32
    lib.sigmoid_mul_rows.argtypes = [ptr, ptr, i64, i64, i64]
    lib.sigmoid_mul_rows.restype = None
    f32 = ctypes.c_float
    lib.decode_attention_rows.argtypes = [ptr, i64, ptr, i64, i64, i64, i64, ptr, ptr, i32, i64, ptr, i64, ptr, i64, f32,
                                          ptr, i64, i32]
    lib.kv_store.argtypes = [ptr, ptr, i64, i32]
    lib.chunk_attention.argtypes = [ptr, i64, ptr, i64, i64, i64, i64, ptr, ptr, i32, i64, ptr, i64, i64, f32, ptr, i32]
    lib.chunk_attention.restype = None
    lib.mla_decode_rows.argtypes = [ptr, i64, i64, ptr, i64, i64, i64, i64, i64, i64, i64, i64, ptr, ptr, i64, ptr, ptr,
                                    i64, ptr, i32, i64, ptr, i64, ptr, f32, i64, ptr, i32]
    lib.mla_decode_rows.restype = i32
    lib.decode_layers.argtypes = [ptr, ptr, ptr, i64, ptr, ptr, i64, ptr, ptr, i64, ptr, i64, ptr, ptr, i64, ptr, ptr,
                                  i32]
    lib.decode_layers.restype = i32
    lib.struct_layouts.argtypes = [ptr]
    lib.int8_vnni.restype = i32
    for fn in (lib.rms_norm_rows, lib.rotary_rows, lib.silu_mul_rows, lib.gelu_tanh_mul_rows,
               lib.decode_attention_rows, lib.kv_store, lib.struct_layouts):
        fn.restype = None
    return lib


def _cpu_key() -> str:
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        flags = ""
    return flags


def build(march: str = "native") -> Path:
    """The library for this CPU (or, for the tests of another code path, for `march`: haswell is the AVX2 one,
    x86-64 the portable one)."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise RuntimeError("no C compiler found (install gcc, or set CC)")
    sources = b"".join(s.read_bytes() for s in SOURCES + HEADERS)
    flags = [f"-march={march}", *FLAGS]
    key = hashlib.sha256(sources + " ".join([compiler, *flags, _cpu_key()]).encode()).hexdigest()[:16]
    out = cache_dir() / "native" / f"cpu_kernels-{key}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    log.info("compiling the CPU kernels for this CPU with %s (once: kept in %s)", compiler, out.parent)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        built = Path(tmp) / out.name
        proc = subprocess.run([compiler, *flags, "-o", str(built), *map(str, SOURCES)], capture_output=True,
                              text=True)
        if proc.returncode != 0:
            errors = "; ".join(line for line in proc.stderr.splitlines() if "error" in line)[:400]
            raise RuntimeError(f"{compiler} could not build the CPU kernels with -march={march}: "
                               f"{errors or proc.stderr.strip()[-400:]}")
        built.replace(out)  # atomic: a concurrent process sees the whole library or none
    return out


