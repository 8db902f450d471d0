"""GGUF blocks repacked for PyTorch's CPU int4 kernel (aten._weight_int4pack_mm_for_cpu).

That kernel computes y = x @ W.T with W in groups of 32 along K, each weight (q4 - 8) * s + z for a
4-bit q4 and a (scale, zero) pair per group, in bf16 (the only dtype it vectorises; fp32 and fp16
inputs run a scalar loop ten times slower than fp32 dense). From formats.decode's w = q * scale + offset:

- 4-bit formats (Q4_0, Q4_1, Q4_K): one plane, q4 = q - lo, z = offset + (lo + 8) * scale.
- 5- and 8-bit formats (Q5_0, Q5_1, Q5_K, Q8_0): q = 16 h + l (h = q >> 4 in [-8, 7], l = q & 15)
  splits into two planes of 4 bits, h with scale 16 s and l with scale s, interleaved group by group
  along K; x is repeated to match, so one kernel call reads both. Keeping h signed leaves no large
  zero to cancel (an offset of 128 s would amplify the bf16 rounding of z). 1.25 bytes a weight for Q8_0.
- Q2_K, Q3_K, Q6_K share a scale per 16 weights, which the kernel cannot express: they are
  requantized to 8 bits per group of 32 (symmetric), adding at most half a step of 1/127 of the
  group's largest weight (tests/backend/test_quant_kernels.py), then packed as Q8_0.

The weights are exact in their integers; scales, zeros, activations and outputs are rounded to bf16
(relative 2**-9), so this path agrees with dequantize + fp32 matmul to about 1e-2, not bit for bit.

The kernel's cost grows with the rows of x at a rate fp32 GEMM beats (on 2 AVX2 cores, 1536x576: 41 ms at
1,024 rows against 21 ms): from DENSE_ROWS rows (prefill chunks) the packed weight is expanded to fp32, in
x's precision, once per call (~1 ms a million weights), and multiplied densely.
"""

import functools
import os

import torch
import torch.nn.functional as F

from backend.quant.formats import Format, decode, dequantize

GROUP = 32
# format -> smallest q of a one-plane (4-bit) format, or None for two planes
_LAYOUT = {"Q4_0": -8, "Q4_1": 0, "Q4_K": 0, "Q5_0": None, "Q5_1": None, "Q5_K": None, "Q8_0": None}


def enabled() -> bool:
    """Repack at load on the CPU, unless SCRIPTORIUM_QUANT_CPU=reference asks for the exact (slow) reference
    path, or this PyTorch lacks the kernel."""
    if os.environ.get("SCRIPTORIUM_QUANT_CPU", "int4pack") == "reference":
        return False
    return hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu")


def _int8_groups(raw: torch.Tensor, fmt: Format, cols: int):
    w = dequantize(raw, fmt, cols).view(raw.shape[0], cols // GROUP, GROUP)
    scale = w.abs().amax(dim=-1) / 127
    q = torch.where(scale[..., None] > 0, torch.round(w / scale[..., None].clamp(min=1e-30)), 0)
    return q.to(torch.int32).clamp_(-127, 127), scale, None


def pack(raw: torch.Tensor, fmt: Format, cols: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """raw [N, row_bytes] -> (int4 weights [N16, planes*cols/2] uint8, scales_zeros [groups, N16, 2] bf16, planes)."""
    rows = raw.shape[0]
    groups = cols // GROUP
    if fmt.name in _LAYOUT:
        lo = _LAYOUT[fmt.name]
        q, scale, offset = decode(raw, fmt)
        q = q.view(rows, groups, GROUP).to(torch.int32)
        scale = scale.reshape(rows, groups)
        offset = offset.reshape(rows, groups) if offset is not None else torch.zeros_like(scale)
    else:
        lo = None
        q, scale, offset = _int8_groups(raw, fmt, cols)
        offset = torch.zeros_like(scale)
    planes = 1 if lo is not None else 2
    if planes == 1:
        q4, s, z = (q - lo)[:, :, None], scale[..., None], (offset + (lo + 8) * scale)[..., None]
    else:
        q4 = torch.stack([(q >> 4) + 8, q & 15], dim=2)
        s = torch.stack([16 * scale, scale], dim=-1)
        z = torch.stack([torch.zeros_like(scale), offset + 8 * scale], dim=-1)
    q4, s, z = q4.reshape(rows, -1), s.reshape(rows, -1), z.reshape(rows, -1)
    pad = -rows % 16  # the kernel takes N in multiples of 16; padding rows weigh zero
    if pad:
        q4 = torch.cat([q4, torch.full((pad, q4.shape[1]), 8, dtype=q4.dtype)])
        s = torch.cat([s, s.new_zeros(pad, s.shape[1])])
        z = torch.cat([z, z.new_zeros(pad, z.shape[1])])
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q4.to(torch.int32).contiguous(), 2)
    scales_zeros = torch.stack([s, z], dim=-1).transpose(0, 1).contiguous().to(torch.bfloat16)
    return packed, scales_zeros, planes


DENSE_ROWS = 256  # measured break-even ~200 rows (bench: int4pack vs expand + fp32 GEMM)


def expand(packed: torch.Tensor, scales_zeros: torch.Tensor, planes: int, cols: int,
           dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The packed weight as the kernel reads it, [N16, cols] in `dtype`: (q4 - 8) * s + z per group, the two
    planes of a 5/8-bit format summed. Layout of _convert_weight_to_int4pack_for_cpu (checked by
    dense_layout_ok): blocks of 32 rows, each K columns of 16 bytes whose low nibble is row i of the block
    and high nibble row 16 + i; a last block of 16 rows packs rows 2j and 2j + 1 in byte j."""
    n16, wide = scales_zeros.shape[1], planes * cols
    q = torch.empty(n16, wide, dtype=dtype)
    full = n16 // 32 * 32
    if full:
        p = packed[: full * wide // 2].view(full // 32, wide, 16).transpose(1, 2)
        dst = q[:full].view(full // 32, 2, 16, wide)
        dst[:, 0].copy_(p & 15)
        dst[:, 1].copy_(p >> 4)
    if n16 > full:
        p = packed[full * wide // 2:].view(wide, 8).t()
        dst = q[full:].view(8, 2, wide)
        dst[:, 0].copy_(p & 15)
        dst[:, 1].copy_(p >> 4)
    s = scales_zeros[..., 0].t().to(dtype)[..., None]
    z = scales_zeros[..., 1].t().to(dtype)[..., None] - 8 * s
    w = q.view(n16, wide // GROUP, GROUP).mul_(s).add_(z)
    if planes == 2:  # groups of the two planes interleaved along K: h of group g, then l of group g
        return w.view(n16, cols // GROUP, 2, GROUP).sum(dim=2).view(n16, cols)
    return w.view(n16, cols)


@functools.cache
def dense_layout_ok() -> bool:
    """Whether expand reads this PyTorch's packing: a probe of 48 rows (a full block and a last one)."""
    q = torch.randint(0, 16, (48, 64), generator=torch.Generator().manual_seed(0), dtype=torch.int32)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 2)
    ones = torch.stack([torch.ones(2, 48), torch.full((2, 48), 8.0)], dim=-1).to(torch.bfloat16)
    return packed.dim() == 2 and torch.equal(expand(packed.reshape(-1), ones, 1, 64), q.float())


def matmul(x: torch.Tensor, packed: torch.Tensor, scales_zeros: torch.Tensor, planes: int, rows: int) -> torch.Tensor:
    """x [..., K] -> [..., rows] in x's dtype."""
    flat = x.dim() == 2  # the engine's rows: no reshapes (each op costs microseconds at batch 1)
    cols = x.shape[-1]
    x2 = x if flat else x.reshape(-1, cols)
    if x2.shape[0] >= DENSE_ROWS and x.dtype != torch.bfloat16 and dense_layout_ok():
        y = F.linear(x2, expand(packed.reshape(-1), scales_zeros, planes, cols, x.dtype)[:rows])
        return y if flat else y.reshape(*x.shape[:-1], rows)
    xb = x2.to(torch.bfloat16)
    if planes == 2:
        m = xb.shape[0]
        xb = xb.view(m, cols // GROUP, 1, GROUP).expand(m, cols // GROUP, 2, GROUP).reshape(m, 2 * cols)
    y = torch.ops.aten._weight_int4pack_mm_for_cpu(xb.contiguous(), packed, GROUP, scales_zeros)
    if y.shape[1] != rows:
        y = y[:, :rows]
    y = y.to(x.dtype)
    return y if flat else y.reshape(*x.shape[:-1], rows)
