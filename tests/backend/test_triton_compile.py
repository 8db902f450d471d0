"""Every Triton kernel compiled, down to a cubin by ptxas, for the GPUs our users run, on this CPU-only machine.

The interpreter (test_triton_kernels.py) proves what the kernels compute, but it runs them as Python:
it neither type-checks them as the compiler does nor lays them out in shared memory. Here each
public wrapper is called with the argument types the engine passes (real model shapes, bf16, fp16
and fp32); its launches are recorded instead of run, and each is compiled for sm_90 (H100/H200),
sm_89 (RTX 4090) and sm_80 (A100), its shared memory checked against what the card has
(tests/backend/compile_kernels.py, in a process without the interpreter).
"""

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

from tests.backend.compile_kernels import CASES, QUANT, QUANT_KERNELS, TYPES  # noqa: E402
from tests.backend.server_process import ROOT  # noqa: E402

KERNELS = {"_store_kv_kernel", "_decode_kernel", "_prefill_kernel", "_rms_norm_kernel", "_rotary_kernel",
           "_moe_up_kernel", "_moe_down_kernel", *QUANT_KERNELS}


@pytest.fixture(scope="module")
def compiled():
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "SCRIPTORIUM_TRITON")}
    result = subprocess.run([sys.executable, "-m", "tests.backend.compile_kernels"], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=1800)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [json.loads(line) for line in result.stdout.splitlines()]
    by_case = {}
    for row in rows:
        by_case.setdefault(row["case"], []).append(row)
    return by_case


@pytest.mark.parametrize("capability,dtype,model", CASES)
def test_every_kernel_compiles_for_the_card(capability, dtype, model, compiled):
    from backend.kernels.quant_gemv_triton import BLOCK_FORMATS
    from backend.quant.formats import BY_NAME

    rows = compiled[f"sm_{capability}-{TYPES[dtype]}-{model}"]
    formats, _ = QUANT[CASES.index((capability, dtype, model))]
    # The per-weight GEMV only runs formats the block-wise one does not read.
    per_weight = any(BY_NAME[name].ggml_type not in BLOCK_FORMATS for name in formats)
    assert {r["kernel"] for r in rows} == KERNELS - ({"_qgemv_kernel"} if not per_weight else set())
    for row in rows:
        assert "error" not in row, f"{row['kernel']} {row['constants']}: {row.get('error')}"
        assert row["cubin_bytes"] > 0
        assert row["shared"] <= row["shared_limit"], (
            f"{row['kernel']} needs {row['shared']} bytes of shared memory, the card has {row['shared_limit']}")


@pytest.mark.parametrize("capability", [90, 89])
def test_every_gguf_format_compiles_for_the_card(capability, compiled):
    from backend.kernels.quant_codebook_triton import CODEBOOK_FORMATS
    from backend.kernels.quant_gemv_triton import BLOCK_FORMATS
    from backend.quant.formats import FORMATS

    rows = [r for case in compiled.values() for r in case if r["capability"] == capability]
    # Every format; a few rows of x: the block-wise kernel where it reads the format, the per-weight one elsewhere;
    # a prompt's chunk the per-weight GEMM, but for the codebooks, which only the block-wise kernels read.
    kept = set(FORMATS)
    expected = {"_qgemm_kernel": kept - set(CODEBOOK_FORMATS), "_block_gemv_kernel": kept & set(BLOCK_FORMATS),
                "_block_gemm_kernel": kept & set(BLOCK_FORMATS), "_qgemv_kernel": kept - set(BLOCK_FORMATS)}
    for kernel, formats in expected.items():
        done = {int(r["constants"]["FMT"]) for r in rows if r["kernel"] == kernel}
        assert done == formats, f"{kernel} on sm_{capability} lacks {formats - done}"


def test_a_block_size_the_kernels_cannot_tile_is_refused_on_cuda():
    """Block tables index the cache in blocks; the compiled ones (every case above builds them) are accepted."""
    from backend.engine.kv_budget import CUDA_BLOCK_SIZES, check_cuda_block_size

    for good in CUDA_BLOCK_SIZES:
        check_cuda_block_size(good)
    for bad in (8, 24, 512):
        with pytest.raises(ValueError, match="block_size must be one of 16, 32, 64, 128, 256 on CUDA"):
            check_cuda_block_size(bad)


@pytest.mark.parametrize("capability", [90, 89, 80])
def test_every_accepted_block_size_compiles_within_the_cards_shared_memory(capability, compiled):
    from backend.engine.kv_budget import CUDA_BLOCK_SIZES

    rows = [r for case in compiled.values() for r in case if r["capability"] == capability
            and r["kernel"] in ("_decode_kernel", "_prefill_kernel")]
    for kernel in ("_decode_kernel", "_prefill_kernel"):
        assert {int(r["constants"]["BS"]) for r in rows if r["kernel"] == kernel} == set(CUDA_BLOCK_SIZES)
    for row in rows:  # the shared-memory check itself is test_every_kernel_compiles_for_the_card's
        assert "error" not in row and row["shared"] <= row["shared_limit"], row


def test_the_decode_kernels_read_q4_k_and_q5_k_blocks_without_byte_loads(compiled):
    """Launched as the engine launches them (pointers and sizes multiples of 16, which the launcher tells the
    compiler), the block-wise decode kernels read a Q4_K/Q5_K block's quants in 16-byte vectors and its header (d,
    dmin, the packed scales) as words: no single-byte loads from global memory, whose number bounded the first
    H200 runs (Q4_K at 400-640 GB/s where bf16 weights read 3,090)."""
    rows = [r for case in compiled.values() for r in case
            if r["kernel"] in ("_block_gemv_kernel", "_block_moe_up_kernel", "_block_moe_down_kernel")
            and all(v in ("12", "13") for k, v in r["constants"].items() if k.startswith("FMT"))]
    assert {r["kernel"] for r in rows} == {"_block_gemv_kernel", "_block_moe_up_kernel"}
    for row in rows:
        assert "b8" not in row["loads"] and row["loads"].get("v4.b32", 0) > 0, row
