"""The gated feed-forward of dense layers (and of Qwen2-MoE's shared expert): SiLU, or GELU's tanh form (Gemma)."""

import torch
import torch.nn.functional as F
from torch import nn

from backend.kernels import native


class MLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool, act: str = "silu"):
        super().__init__()
        self.act = act  # model_config.ACTIVATIONS
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=bias)  # gate rows, then up rows
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        return self.down_proj(silu_mul(gate_up) if self.act == "silu" else gelu_tanh_mul(gate_up))


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of [..., 2 * inter] (gate columns, then up): one call of our C kernel on the CPU."""
    out = _c_rows("silu_mul_rows", gate_up)
    if out is not None:
        return out
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_tanh_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gelu(gate) in its tanh approximation, times up (transformers' gelu_pytorch_tanh): our C kernel on the CPU,
    which the one-call decode step calls too (the same bits)."""
    out = _c_rows("gelu_tanh_mul_rows", gate_up)
    if out is not None:
        return out
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def _c_rows(kernel: str, gate_up: torch.Tensor) -> torch.Tensor | None:
    """The C kernel's act(gate) * up where it takes these rows, else None."""
    if not (gate_up.is_contiguous() and native.usable(gate_up)):
        return None
    inter = gate_up.shape[-1] // 2
    out = gate_up.new_empty(*gate_up.shape[:-1], inter)
    getattr(native.library(), kernel)(gate_up.data_ptr(), out.data_ptr(), gate_up.numel() // (2 * inter), inter)
    return out
