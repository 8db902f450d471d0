"""RMSNorm, optionally fused with the residual add that precedes it (torch reference)."""

import torch
import torch.nn.functional as F

from backend.kernels import use_triton


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if use_triton(x):
        from backend.kernels import triton_kernels

        return triton_kernels.rms_norm(x, weight, eps)
    if x.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)  # one fused op, same arithmetic in fp32
    # Computed in fp32 and cast back before the weight, as the Llama/Qwen reference implementations do.
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (rms_norm(x + residual), x + residual)."""
    if use_triton(x):
        from backend.kernels import triton_kernels

        return triton_kernels.rms_norm(x, weight, eps, residual=residual)
    summed = x + residual
    return rms_norm(summed, weight, eps), summed
