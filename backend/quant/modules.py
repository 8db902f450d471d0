"""Layers over weights kept in GGUF blocks: a linear layer, an embedding, and the weight they share.

Paths, by device: CUDA (or SCRIPTORIUM_TRITON=1) decodes the blocks inside Triton matmuls
(backend/kernels/quant_triton.py); the CPU runs our kernel on weights repacked once at load
(cpu_layout.py), a fused layer's parts in one call (cpu_parts.py); otherwise, and as the oracle, the reference
dequantizes and multiplies.
"""

import dataclasses
import itertools

import torch
import torch.nn.functional as F
from torch import nn

from backend.kernels import native, use_triton
from backend.quant import cpu_layout, cpu_parts
from backend.quant.formats import Format, dequantize, row_bytes


class QuantWeight(nn.Module):
    """A [rows, cols] weight (or a stack [*lead, rows, cols] of experts' weights) in one GGUF format,
    or in plain floats (fmt None) where a fused layer mixes the two."""

    def __init__(self, fmt: Format | None, rows: int, cols: int, lead: tuple[int, ...] = (),
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "meta"):
        super().__init__()
        self.fmt, self.rows, self.cols, self.lead = fmt, rows, cols, tuple(lead)
        self.row_bytes = row_bytes(fmt, cols) if fmt is not None else 0
        shape = (*lead, rows, self.row_bytes) if fmt is not None else (*lead, rows, cols)
        self.register_buffer("data", torch.empty(shape, dtype=torch.uint8 if fmt else dtype, device=device))
        # CPU repacking (cpu_layout.py); scales kept as integer bits so that module.to(dtype) leaves them alone.
        self.register_buffer("codes", None)
        self.register_buffer("scales", None)
        self.register_buffer("offsets", None)
        self.layout: cpu_layout.Layout | None = None
        self.keep_data = False  # an embedding reads the blocks too

    @property
    def code(self) -> int:
        return self.fmt.ggml_type if self.fmt is not None else 0

    @property
    def name(self) -> str:
        return self.fmt.name if self.fmt is not None else str(self.data.dtype).removeprefix("torch.")

    def extra_repr(self) -> str:
        return f"{self.name}, rows={self.rows}, cols={self.cols}" + (f", lead={self.lead}" if self.lead else "")

    def pack_for_cpu(self, products: str = "float32") -> None:
        """Repack the blocks for our CPU kernel; products (arithmetic.products): "bfloat16" stores the codes in AMX
        tiles' order where the CPU has them, "int8" four k's to a lane for products against 8-bit activations, and
        otherwise (fp32, or bf16 off the tiles) the same where the kernel build has VNNI, for products against x in
        three 8-bit digits (cpu_layout's "digits": fp32's precision, faster there than fp32 products), else the fp32
        kernel's panels."""
        if self.fmt is None or self.layout is not None:
            return
        flat = self.data.reshape(-1, self.rows, self.row_bytes)
        packs = [cpu_layout.pack(m, self.fmt, self.cols) for m in flat]
        if len({p[3] for p in packs}) > 1:  # a stack's experts read one way: fp32 where their scales differ in kind
            packs = [cpu_layout.pack(m, self.fmt, self.cols, cpu_layout.SCALES_FP32) for m in flat]
        layout = packs[0][3]
        # An expert stack is in panels or quads (cpu_moe.c reads both): not AMX tiles' pairs.
        if self.cols % 32 == 0 and native.enabled():
            if products == "bfloat16" and native.amx() and not self.lead:  # every product bf16's, on the tiles
                if cpu_layout.tabled(layout.bits):  # whose kernels look up no table: the values' 8-bit codes
                    packs = [(cpu_layout.untabled(p[0], layout.bits), *p[1:]) for p in packs]
                    layout = dataclasses.replace(layout, bits=8)
                bits = cpu_layout.paired_bits([p[0] for p in packs], layout.bits)
                packs = [(cpu_layout.pair_order(p[0], bits), *p[1:]) for p in packs]
                layout = dataclasses.replace(layout, bits=bits, order="pairs")
            elif products == "int8" or native.vnni():
                bits = cpu_layout.quad_bits([p[0] for p in packs], layout.bits)
                packs = [(cpu_layout.quad_order(p[0], bits), *p[1:]) for p in packs]
                layout = dataclasses.replace(layout, bits=bits, order="quads" if products == "int8" else "digits")
        self.layout = layout
        for i, name in enumerate(("codes", "scales", "offsets")):
            if packs[0][i] is not None:
                setattr(self, name, torch.stack([p[i] for p in packs]).reshape(*self.lead, *packs[0][i].shape))
        if not self.keep_data:
            self.data = None

    def c_matrix(self) -> cpu_parts.QuantMatrix:
        """This repacked weight as the C kernels take it."""
        return cpu_parts.quant_matrix(self.codes, self.scales, self.offsets, self.layout, self.rows, self.cols)

    def tensors(self) -> list[torch.Tensor]:
        """What one expert of a stack is made of, as stacks to slice (ExpertCache copies them)."""
        if self.layout is None:
            return [self.data]
        return [self.codes, self.scales] + ([self.offsets] if self.layout.offsets else [])

    def tensor_count(self) -> int:
        return 1 if self.layout is None else 2 + self.layout.offsets

    def dequantize(self, dtype: torch.dtype, expert: int | None = None) -> torch.Tensor:
        data = self.data if expert is None else self.data[expert]
        if self.fmt is None:
            return data.to(dtype)
        return dequantize(data, self.fmt, self.cols, dtype)

    def matmul(self, x: torch.Tensor, expert: int | None = None, tensors: list[torch.Tensor] | None = None):
        """x [..., cols] @ W.T -> [..., rows]: W itself, or expert `expert` of the stack (or of `tensors`,
        stacks shaped as tensors() gives them)."""
        if self.layout is not None and expert is None and tensors is None and not x.is_cuda:  # a decode step's path
            return cpu_layout.matmul(x, self.codes, self.scales, self.offsets, self.layout, self.rows)
        tensors = tensors if tensors is not None else self.tensors()
        if self.layout is not None:
            if x.is_cuda:
                raise RuntimeError("this weight was repacked for the CPU at load; load the model again for CUDA")
            codes, scales, *offsets = (t if expert is None else t[expert] for t in tensors)
            return cpu_layout.matmul(x, codes, scales, offsets[0] if offsets else None, self.layout, self.rows)
        data = tensors[0] if expert is None else tensors[0][expert]
        if self.fmt is None:
            return F.linear(x, data)
        if use_triton(x):
            from backend.kernels.quant_triton import qlinear

            lead = x.shape[:-1]
            y = qlinear(x.reshape(-1, self.cols), data, self.code, self.rows, self.cols, self.row_bytes)
            return y.reshape(*lead, self.rows)
        return F.linear(x, dequantize(data, self.fmt, self.cols, x.dtype))

    def nbytes(self) -> int:
        tensors = (self.data, self.codes, self.scales, self.offsets)
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)


class QuantLinear(nn.Module):
    """y = x @ W.T + b, W's rows in parts stacked in order (q|k|v, gate|up), each part in its own format."""

    def __init__(self, in_features: int, parts: list[QuantWeight], bias: bool, dtype: torch.dtype):
        super().__init__()
        self.in_features = in_features
        self.out_features = sum(p.rows for p in parts)
        self.parts = nn.ModuleList(parts)
        self.bias = nn.Parameter(torch.empty(self.out_features, dtype=dtype, device="meta")) if bias else None
        self.plan: _Plan | None = None  # outputs_of's, built at the first call

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return outputs_of([self], x)[0]


def outputs_of(linears: list[QuantLinear], x: torch.Tensor) -> list[torch.Tensor]:
    """Each QuantLinear's y for the one input x (q|k|v's parts, or two layers of one input): on the CPU, every part
    repacked for our kernel in one C call (cpu_parts.py: x quantized once, not once a part; no torch.cat), the ys
    views of one [..., sum of out_features] tensor; elsewhere part by part."""
    plan = None if x.is_cuda else _plan(linears)
    if plan is None:
        ys = [[p.matmul(x) for p in linear.parts] for linear in linears]
        ys = [y[0] if len(y) == 1 else torch.cat(y, dim=-1) for y in ys]
    else:
        rows = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
        x2 = rows if rows.dtype == torch.float32 and rows.is_contiguous() else rows.float().contiguous()
        y = torch.empty(x2.shape[0], plan.width)
        cpu_parts.matmul_parts(x2, plan.call, y)
        for p, at in plan.floats:
            y[:, at : at + p.rows] = p.matmul(rows)
        y = y.to(x.dtype) if x.dim() == 2 else y.to(x.dtype).reshape(*x.shape[:-1], plan.width)
        ys = y.split(plan.widths, dim=-1) if len(linears) > 1 else [y]
    return [y if linear.bias is None else y + linear.bias for y, linear in zip(ys, linears)]


@dataclasses.dataclass(frozen=True)
class _Plan:
    """How outputs_of runs some QuantLinears of one input on the CPU (kept on the first of them): the C call for their
    repacked parts, the parts in plain floats with their first columns, each linear's width and all of them."""

    key: tuple[int, ...]  # the linears, and where their parts' codes lie
    call: cpu_parts.PartsCall
    floats: tuple[tuple[QuantWeight, int], ...]
    widths: list[int]
    width: int


def _plan(linears: list[QuantLinear]) -> _Plan | None:
    """None where the parts run one by one: a lone part (cpu_layout.matmul's one call), or none repacked."""
    if len(linears) == 1 and len(linears[0].parts) == 1:
        return None
    parts = [p for linear in linears for p in linear.parts]
    key = (*map(id, linears), *(p.codes.data_ptr() if p.layout is not None else 0 for p in parts))
    plan = linears[0].plan
    if plan is not None and plan.key == key:
        return plan
    at = list(itertools.accumulate((p.rows for p in parts), initial=0))
    packed = [(p, a) for p, a in zip(parts, at) if p.layout is not None]
    if not packed:
        return None
    call = cpu_parts.parts_call([p.c_matrix() for p, _ in packed], [a for _, a in packed])
    floats = tuple((p, a) for p, a in zip(parts, at) if p.layout is None)
    linears[0].plan = _Plan(key, call, floats, [linear.out_features for linear in linears], at[-1])
    return linears[0].plan


class QuantEmbedding(nn.Module):
    """Rows of a quantized embedding table, dequantized as they are looked up (only those rows are read)."""

    def __init__(self, weight: QuantWeight, dtype: torch.dtype):
        super().__init__()
        self.weight = weight
        self.weight.keep_data = True
        self.dtype = dtype

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        w, lay = self.weight, self.weight.layout
        if lay is not None and lay.order != "pairs" and w.codes is not None \
                and self.dtype == torch.float32 and not ids.is_cuda and native.enabled():
            # from the repacked table (an output layer tied to it, or the repack of every weight): one C call, not
            # the ~25 torch ops of dequantize (0.23-0.35 ms of a decode step, a tenth of a small MoE's)
            flat = ids.reshape(-1).to(torch.int64).contiguous()
            out = torch.empty(flat.numel(), w.cols)
            if not native.library().rows_of_packed(
                    w.codes.data_ptr(), w.scales.data_ptr(), w.offsets.data_ptr() if lay.offsets else None, w.rows,
                    w.cols, lay.group, lay.bits, lay.scale_kind, lay.order_code, flat.data_ptr(), flat.numel(), out.data_ptr()):
                raise IndexError(f"a token id outside the embedding table's {w.rows} rows")
            return out.reshape(*ids.shape, w.cols)
        return dequantize(w.data[ids.reshape(-1)], w.fmt, w.cols, self.dtype).reshape(*ids.shape, w.cols)
