"""Fields of GGUF blocks read in torch: fp16 values, and bit fields packed along runs of bytes."""

import torch


def f16(b: torch.Tensor) -> torch.Tensor:
    """Two bytes (the last dim) as fp16, widened to fp32: [..., 2] uint8 -> [..., 1]."""
    return b.contiguous().view(torch.float16).float()


def bits(qh: torch.Tensor, shifts: int, width: int, chunk: int) -> torch.Tensor:
    """[n, bytes] -> [n, bytes * shifts]: for each run of `chunk` bytes, the fields at bit 0, width, 2*width..."""
    n = qh.shape[0]
    by = torch.arange(0, shifts * width, width, dtype=torch.uint8, device=qh.device).view(1, 1, shifts, 1)
    return ((qh.reshape(n, -1, 1, chunk) >> by) & ((1 << width) - 1)).view(n, -1)


def nibbles(qs: torch.Tensor, chunk: int) -> torch.Tensor:
    """[n, bytes] -> [n, 2 * bytes]: each run of `chunk` bytes gives its low nibbles, then its high ones."""
    return bits(qs, 2, 4, chunk)


def words(b: torch.Tensor, width: int) -> torch.Tensor:
    """[n, bytes] -> [n, bytes / (width / 8)] int64: little-endian unsigned 16- or 32-bit words."""
    view = torch.int16 if width == 16 else torch.int32
    return b.contiguous().view(view).to(torch.int64) & ((1 << width) - 1)
