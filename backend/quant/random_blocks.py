"""Random weights in a GGUF block format, drawn on the device: real shapes of quantized models with nothing to
download (bench/device.py's Mixtral-8x7B-shaped Q4_K figure). The integer fields are random bytes; the fp16
scale fields are overwritten with small positive values, so every weight is finite and near the size of a
trained model's."""

import torch
from torch import nn

from backend.quant.formats import Format
from backend.quant.hf_quantize import replace_layers
from backend.quant.modules import QuantWeight

# byte offsets of each format's fp16 fields (d, then dmin or m where it has one) and the size of d
_SCALES = {"Q4_0": ((0,), 0.01), "Q4_1": ((0, 2), 0.01), "Q5_0": ((0,), 0.005), "Q5_1": ((0, 2), 0.005),
           "Q8_0": ((0,), 0.0005), "Q2_K": ((80, 82), 0.005), "Q3_K": ((108,), 0.002), "Q4_K": ((0, 2), 0.0003),
           "Q5_K": ((0, 2), 0.00015), "Q6_K": ((208,), 0.00008), "IQ2_XXS": ((0,), 0.0006),
           "IQ2_XS": ((0,), 0.0006), "IQ2_S": ((0,), 0.0006), "IQ3_XXS": ((0,), 0.0006), "IQ3_S": ((0,), 0.0008),
           "IQ1_S": ((0,), 0.012), "IQ4_NL": ((0,), 0.0008), "IQ4_XS": ((0,), 0.00005), "TQ1_0": ((52,), 0.05),
           "TQ2_0": ((64,), 0.05)}


def quantize_meta(model: nn.Module, fmt: Format, dtype: torch.dtype) -> None:
    """On the meta model: the layers hf_quantize quantizes become `fmt` blocks, still without memory."""
    replace_layers(model, lambda w: QuantWeight(fmt, w.shape[-2], w.shape[-1], tuple(w.shape[:-2]), dtype=dtype,
                                                device="meta"), fmt.block)


def fill_random(model: nn.Module, generator: torch.Generator) -> None:
    for m in model.modules():
        if isinstance(m, QuantWeight) and m.fmt is not None:
            _fill(m.data, m.fmt, generator)


def _fill(data: torch.Tensor, fmt: Format, generator: torch.Generator) -> None:
    blocks = data.view(-1, fmt.block_bytes)
    blocks.copy_(torch.randint(0, 256, blocks.shape, dtype=torch.uint8, device=data.device, generator=generator))
    if fmt.name in ("MXFP4", "IQ1_M"):
        _fill_split_scale(blocks, fmt.name, generator)
        return
    offsets, size = _SCALES[fmt.name]
    for i, at in enumerate(offsets):
        scale = torch.rand(blocks.shape[0], device=data.device, generator=generator) + 0.5
        scale = (scale * size * (1.0 if i == 0 else 0.5)).to(torch.float16)
        blocks[:, at:at + 2] = scale.view(torch.uint8).view(-1, 2)


def _fill_split_scale(blocks: torch.Tensor, name: str, generator: torch.Generator) -> None:
    """MXFP4's scale is a power of two in a byte (2^(e - 128): 1/256 .. 1/64 here); IQ1_M's fp16 d is the top
    nibbles of its four scale words (bytes 48..55), lowest first."""
    n = blocks.shape[0]
    if name == "MXFP4":
        blocks[:, 0] = torch.randint(120, 123, (n,), dtype=torch.uint8, device=blocks.device, generator=generator)
        return
    d = ((torch.rand(n, device=blocks.device, generator=generator) + 0.5) * 0.012).to(torch.float16)
    d = d.view(torch.int16).to(torch.int32) & 0xFFFF
    words = blocks[:, 48:56].contiguous().view(torch.int16).to(torch.int32) & 0xFFFF
    shifts = torch.tensor([0, 4, 8, 12], device=blocks.device)
    words = (words & 0x0FFF) | (((d[:, None] >> shifts) & 0xF) << 12)
    blocks[:, 48:56] = (words - ((words >> 15) << 16)).to(torch.int16).view(torch.uint8).view(n, 8)
