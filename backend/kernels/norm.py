"""RMSNorm, optionally fused with the residual add that precedes it: the torch reference, our C kernel on the
CPU (native.py), Triton on CUDA."""

import torch
import torch.nn.functional as F

from backend.kernels import native, use_triton


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if use_triton(x):
        from backend.kernels import triton_kernels

        return triton_kernels.rms_norm(x, weight, eps)
    if native.usable(x, weight):
        # Strided rows too (Qwen3's q/k heads, a slice of the projection when it has several rows): copied, so
        # that the C kernel, not F.rms_norm, computes every row count (the one-call step's bits)
        x = x.contiguous()
        out = torch.empty_like(x)
        native.library().rms_norm_rows(x.data_ptr(), None, weight.data_ptr(), None, out.data_ptr(),
                                       x.numel() // x.shape[-1], x.shape[-1], eps)
        return out
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
    if x.is_contiguous() and residual.is_contiguous() and native.usable(x, residual, weight):
        summed, out = torch.empty_like(x), torch.empty_like(x)
        native.library().rms_norm_rows(x.data_ptr(), residual.data_ptr(), weight.data_ptr(), summed.data_ptr(),
                                       out.data_ptr(), x.numel() // x.shape[-1], x.shape[-1], eps)
        return out, summed
    summed = x + residual
    return rms_norm(summed, weight, eps), summed
