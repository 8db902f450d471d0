"""A MoE layer's experts kept in GGUF blocks: gate [E, I, H], up [E, I, H], down [E, H, I].

Computed as backend/kernels/moe_torch.py computes float experts: on CUDA one fused pair of grouped GEMMs
(quant_moe_triton.py), elsewhere grouped by expert, one matmul per active expert; on the CPU with our kernels the
experts of a few tokens (a decode step of up to FEW_TOKENS sequences), and a prompt's in blocks of PROMPT_TOKENS
where the 8-bit kernel reads the stacks, in one C call (cpu_moe.c), with the same arithmetic.
"""

import ctypes

import torch
from torch import nn

from backend.kernels import native, use_triton
from backend.kernels.moe_torch import expert_groups, swiglu_clamped
from backend.models.mlp import silu_mul
from backend.quant.modules import QuantWeight

# Tokens a step may have for its experts to go through one C call (cpu_moe.c): a decode batch, a short prompt. A
# longer prompt's chunk takes the per-expert loop, whose matmuls of many rows decode each weight once for all.
# Where a tile meets 4 rows (AVX2, portable), the call decodes an expert's weights again every 4 rows: 16 tokens
# (Qwen3-30B-A3B-shaped, 32 experts, AVX2 build: 1.18x the loop at 16, 0.98x at 32, 0.89x at 64; AVX-512 1.10x at 64).
FEW_TOKENS = 64
FEW_TOKENS_NARROW = 16
# Stacks in quad order (8-bit activations, or x in three 8-bit digits) take any number of tokens through the call,
# this many at a time: each expert's rows meet each of its panels in one job, and the loop's gathering of tokens
# and scattering of results (a sixth of a prompt's time) is gone. The block bounds the call's scratch, which its
# thread keeps: 256 tokens of Qwen3-30B-A3B's widths at top-8 in three digits, about 60 MB.
PROMPT_TOKENS = 256


# gpt-oss's expert biases: gate|up [E, 2I] and down [E, H] (either may be None), or None
Biases = tuple[torch.Tensor | None, torch.Tensor | None] | None


def one_call_tokens() -> int:
    """The most tokens whose experts go through one C call on this CPU's build."""
    return FEW_TOKENS if native.tile_rows() >= 16 else FEW_TOKENS_NARROW


class ExpertStack(ctypes.Structure):  # cpu_exports.h's
    _fields_ = [
        ("codes", ctypes.c_void_p),
        ("scales", ctypes.c_void_p),
        ("offsets", ctypes.c_void_p),
        ("codes_stride", ctypes.c_int64),
        ("params_stride", ctypes.c_int64),
        ("rows", ctypes.c_int64),
        ("cols", ctypes.c_int64),
        ("group", ctypes.c_int64),
        ("bits", ctypes.c_int64),
        ("scale_kind", ctypes.c_int64),
        ("order", ctypes.c_int64),
    ]


def expert_stack(w: QuantWeight) -> ExpertStack:
    lay = w.layout
    return ExpertStack(
        w.codes.data_ptr(),
        w.scales.data_ptr(),
        w.offsets.data_ptr() if lay.offsets else None,
        w.codes.stride(0) * w.codes.element_size(),
        w.scales.stride(0) * w.scales.element_size(),
        w.rows,
        w.cols,
        lay.group,
        lay.bits,
        lay.scale_kind,
        lay.order_code,
    )


class QuantExperts(nn.Module):
    def __init__(self, gate: QuantWeight, up: QuantWeight, down: QuantWeight):
        super().__init__()
        self.gate, self.up, self.down = gate, up, down
        self.num_experts = gate.lead[0]

    def weights(self) -> tuple[QuantWeight, QuantWeight, QuantWeight]:
        return self.gate, self.up, self.down

    def tensors(self) -> list[torch.Tensor]:
        """Every per-expert stack, in order (what ExpertCache keeps in host memory and copies to slots)."""
        return [t for w in self.weights() for t in w.tensors()]

    def host_part(self, first: int) -> "QuantExperts":
        """Experts [first, E) as a module of their own in host memory, repacked for our CPU kernel where it runs
        (what SplitExperts computes on the CPU). This module keeps its stacks."""
        from backend.quant import cpu_layout

        parts = []
        for w in self.weights():
            part = QuantWeight(w.fmt, w.rows, w.cols, (self.num_experts - first,), device="meta")
            if w.layout is not None:  # repacked already (a model on the CPU)
                part.layout = w.layout
                for name in ("codes", "scales", "offsets"):
                    if getattr(w, name) is not None:
                        setattr(part, name, getattr(w, name)[first:].to("cpu", copy=True))
                part.data = None
            else:
                part.data = w.data[first:].to("cpu", copy=True)
                if cpu_layout.enabled():
                    part.pack_for_cpu("float32")
            parts.append(part)
        return QuantExperts(*parts)

    def release(self) -> None:
        """Drop the stacks from the module once an ExpertCache holds them (module.to() must not move them)."""
        for w in self.weights():
            w.data = w.codes = w.scales = w.offsets = None

    def _split(self, tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
        out, i = [], 0
        for w in self.weights():
            n = w.tensor_count()
            out.append(tensors[i : i + n])
            i += n
        return out

    def forward(
        self,
        x: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        tensors: list[torch.Tensor] | None = None,
        biases: Biases = None,
        clamped_swiglu: tuple[float, float] | None = None,
    ) -> torch.Tensor:
        """x [T, H]; topk_* [T, K] -> [T, H]. tensors: the stacks to use instead of the module's own. gpt-oss's
        experts: biases (gate|up [E, 2I], down [E, H]) and clamped_swiglu's (alpha, limit) as fused_moe takes them."""
        g, u, d = self._split(tensors if tensors is not None else self.tensors())
        if use_triton(x) and len(g) == len(u) == len(d) == 1:
            from backend.kernels import quant_moe_triton

            return quant_moe_triton.fused_moe(
                x,
                (g[0], self.gate.code, self.gate.row_bytes),
                (u[0], self.up.code, self.up.row_bytes),
                (d[0], self.down.code, self.down.row_bytes),
                topk_weights,
                topk_ids,
                biases=biases,
                clamped_swiglu=clamped_swiglu,
            )
        if tensors is None and native.usable(x, topk_weights) and self.packed() and self._call_takes(x):
            out = self._one_call(x, topk_weights, topk_ids, biases, clamped_swiglu)
            if out is not None:
                return out
        weights = topk_weights.flatten()
        out = torch.zeros_like(x)
        b_gate_up, b_down = biases or (None, None)
        for expert, pairs, tokens in expert_groups(topk_ids, g[0].shape[0]):
            xe = x[tokens]
            gate_up = torch.cat([self.gate.matmul(xe, expert, g), self.up.matmul(xe, expert, u)], dim=-1)
            if b_gate_up is not None:
                gate_up = gate_up + b_gate_up[expert]
            h = silu_mul(gate_up) if clamped_swiglu is None else swiglu_clamped(gate_up, *clamped_swiglu)
            y = self.down.matmul(h, expert, d)
            if b_down is not None:
                y = y + b_down[expert]
            out.index_add_(0, tokens, (y * weights[pairs, None]).to(out.dtype))
        return out

    def packed(self) -> bool:
        """Whether every stack is in our kernel's layout, one order for all three (the fp32 kernel's panels, or quads
        for 8-bit activations or fp32's in digits; not AMX tiles' pairs), in the module (not an ExpertCache's
        slots)."""
        layouts = [w.layout for w in self.weights() if w.codes is not None]
        return (
            len(layouts) == 3
            and None not in layouts
            and len({lay.order for lay in layouts}) == 1
            and layouts[0].order != "pairs"
        )

    def stacks(self) -> list[ExpertStack]:
        """gate, up and down as cpu_moe.c reads them (built once per call: the one-call decoder keeps its own)."""
        return [expert_stack(w) for w in self.weights()]

    def _call_takes(self, x: torch.Tensor) -> bool:
        """Whether these tokens' experts go through C calls (which raise the IndexError for bad expert ids)."""
        return x.shape[0] <= one_call_tokens() or self.gate.layout.order in ("quads", "digits")

    def _one_call(
        self,
        x: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        biases: Biases = None,
        clamped_swiglu: tuple[float, float] | None = None,
    ) -> torch.Tensor | None:
        """x [T, H]: the loop's result from one C call per block of PROMPT_TOKENS tokens (None where a call found no
        memory: the loop runs instead)."""
        ids, weights = topk_ids.to(torch.int64).contiguous(), topk_weights.float().contiguous()
        out = x.new_empty(x.shape[0], self.down.rows)
        x = x.contiguous()
        stacks = [ctypes.byref(s) for s in self.stacks()]
        b = [None if t is None else t.float().contiguous() for t in (biases or (None, None))]
        alpha, limit = clamped_swiglu or (0.0, 0.0)
        lib, k, threads = native.library(), ids.shape[1], torch.get_num_threads()
        block = max(PROMPT_TOKENS, one_call_tokens())
        for first in range(0, x.shape[0], block):
            n = min(block, x.shape[0] - first)
            args = (
                x[first].data_ptr(),
                n,
                ids[first].data_ptr(),
                weights[first].data_ptr(),
                k,
                self.num_experts,
                *stacks,
            )
            if biases is None and clamped_swiglu is None:
                done = lib.moe_tokens(*args, out[first].data_ptr(), threads)
            else:
                done = lib.moe_tokens_biased(
                    *args,
                    *(None if v is None else v.data_ptr() for v in b),
                    alpha,
                    limit,
                    out[first].data_ptr(),
                    threads,
                )
            if done < 0:
                raise IndexError(f"an expert id outside this layer's {self.num_experts} experts")
            if not done:
                return None
        return out

    def nbytes(self) -> int:
        return sum(w.nbytes() for w in self.weights())
