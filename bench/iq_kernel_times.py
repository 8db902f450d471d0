"""Where an IQ4 prompt's matmul time goes, one JSON line: one thread of our CPU kernel on SmolLM2's shapes (ffn_up /
ffn_gate 1536x576 in IQ4_NL, ffn_down 576x1536 in IQ4_XS), the weights in three forms in the same run: the 4-bit table
codes the loader keeps (looked up by a byte shuffle), the same weights as 8-bit codes of their values (no lookup), and
Q4_0 / Q8_0 weights of the shape (plain 4- and 8-bit codes); prompt-sized batches (--rows) and one row. With the fp32
engine on a CPU with AVX-512 VNNI every one of them is cpu_int8.c's three-digit path; int_macs_per_ns is its rate of
8-bit multiply-adds (three a weight and row of x), to set beside the core's vpdpbusd peak (64 a cycle).

python bench/iq_kernel_times.py [--rows 64] [--repeats 100]
"""

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

SHAPES = (("IQ4_NL", 1536, 576), ("IQ4_XS", 576, 1536), ("Q4_0", 1536, 576), ("Q8_0", 1536, 576))


def packed(name: str, rows: int, cols: int, untabled: bool = False):
    """The weights as the fp32 engine's loader packs them on a VNNI CPU (order "digits"); untabled: a table's codes
    as the 8-bit codes of their values."""
    import torch

    from backend.quant import cpu_layout
    from backend.quant.formats import BY_NAME
    from tests.backend.quant_blocks import random_raw

    raw = torch.from_numpy(random_raw(name, rows, cols, seed=1))
    codes, scales, offsets, layout = cpu_layout.pack(raw, BY_NAME[name], cols)
    if untabled:
        codes, layout = cpu_layout.untabled(codes, layout.bits), dataclasses.replace(layout, bits=8)
    bits = cpu_layout.quad_bits([codes], layout.bits)
    layout = dataclasses.replace(layout, bits=bits, order="digits")
    return cpu_layout.quad_order(codes, bits), scales, offsets, layout


def best_ms(x, weights, rows: int, repeats: int) -> float:
    from backend.quant import cpu_layout

    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        cpu_layout.matmul(x, *weights, rows)
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=64, help="rows of x of the prompt-sized matmuls")
    parser.add_argument("--repeats", type=int, default=100)
    args = parser.parse_args()
    import torch

    from backend.kernels import native

    torch.set_num_threads(1)
    if not native.vnni():
        raise SystemExit(
            "this CPU's build has no AVX-512 VNNI: the fp32 engine takes the fp32 kernel, not the digits"
        )
    out = []
    for m in (args.rows, 1):
        for name, rows, cols in SHAPES:
            x = torch.randn(m, cols, generator=torch.Generator().manual_seed(0))
            forms = {"codes": packed(name, rows, cols)}
            if name.startswith("IQ4"):
                forms["values_8_bit"] = packed(name, rows, cols, untabled=True)
            same = len({cpu_layout_bits(x, w, rows) for w in forms.values()}) == 1
            times = {
                form: round(best_ms(x, w, rows, args.repeats if m > 1 else 20 * args.repeats), 4)
                for form, w in forms.items()
            }
            row = {"rows_x": m, "format": name, "shape": [rows, cols], "ms": times, "same_bits": same}
            row["int_macs_per_ns"] = round(m * rows * cols * 3 / (min(times.values()) * 1e6), 1)
            out.append(row)
    print(json.dumps({"bench": "iq-kernel-times", "threads": 1, "rows": out}))


def cpu_layout_bits(x, weights, rows: int) -> bytes:
    from backend.quant import cpu_layout

    return cpu_layout.matmul(x, *weights, rows).numpy().tobytes()


if __name__ == "__main__":
    main()
