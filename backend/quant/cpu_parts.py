"""Several weights repacked for our CPU kernel (cpu_layout.py) multiplied by one input in one C call (cpu_dispatch.c's
qmm_parts): a fused layer's q|k|v or gate|up, or the linear-attention layer's two input projections.

Each part writes its own columns of one output, so there is no torch.cat copying them again; where the parts are in
quad order (8-bit activations, or an exact engine's x in three 8-bit digits), x is quantized once for all the parts
that read it alike (the same group and bits), not once a part. Each part's columns are the bits its own matmul gives.
The call's arguments are built once (PartsCall): a decode step makes dozens of these calls, and building them took
about as long as a one-row matmul of SmolLM2's widths.
"""

import ctypes
from dataclasses import dataclass

import torch

from backend.kernels import native
from backend.quant.cpu_layout import Layout

i64, ptr = ctypes.c_int64, ctypes.c_void_p


class QuantMatrix(ctypes.Structure):  # cpu_exports.h's
    _fields_ = [
        ("codes", ptr),
        ("scales", ptr),
        ("offsets", ptr),
        ("rows", i64),
        ("cols", i64),
        ("group", i64),
        ("bits", i64),
        ("scale_kind", i64),
        ("order", i64),
    ]


def quant_matrix(
    codes: torch.Tensor,
    scales: torch.Tensor,
    offsets: torch.Tensor | None,
    layout: Layout,
    rows: int,
    cols: int,
) -> QuantMatrix:
    """A repacked [rows, cols] weight as the C kernels take it."""
    return QuantMatrix(
        codes.data_ptr(),
        scales.data_ptr(),
        offsets.data_ptr() if offsets is not None else None,
        rows,
        cols,
        layout.group,
        layout.bits,
        layout.scale_kind,
        layout.order_code,
    )


@dataclass(frozen=True)
class PartsCall:
    """qmm_parts' arguments for some weights of one input width: each part and the first column of its output."""

    matrices: ctypes.Array
    columns: ctypes.Array
    count: int
    cols: int


def parts_call(parts: list[QuantMatrix], columns: list[int]) -> PartsCall:
    """The call for these parts (their tensors kept alive by the caller), part i into y's columns from columns[i]."""
    if len({p.cols for p in parts}) != 1:
        raise ValueError(f"parts of {sorted({p.cols for p in parts})} columns cannot share an input")
    count = len(parts)
    return PartsCall((QuantMatrix * count)(*parts), (i64 * count)(*columns), count, parts[0].cols)


def matmul_parts(x: torch.Tensor, call: PartsCall, y: torch.Tensor) -> None:
    """y[:, columns[i] : columns[i] + rows of part i] = x @ part i's W.T, for x [m, K] and y [m, n] fp32 and
    contiguous."""
    if x.dtype != torch.float32 or y.dtype != torch.float32 or not (x.is_contiguous() and y.is_contiguous()):
        raise ValueError("the parts' matmul takes fp32 rows, contiguous")
    if x.shape[1] != call.cols:
        raise ValueError(f"an input of {x.shape[1]} columns for weights of {call.cols}")
    native.library().qmm_parts(
        x.data_ptr(),
        x.shape[0],
        call.matrices,
        call.columns,
        call.count,
        y.data_ptr(),
        y.shape[1],
        torch.get_num_threads(),
    )
