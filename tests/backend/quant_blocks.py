"""Random quantized weights for the kernel tests: gguf-py quantizes the 32-blocks; K-quants come from random
bytes with sane fp16 scales written over their scale fields."""

import numpy as np
import torch
from gguf import GGMLQuantizationType as T
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import dequantize, quantize

from backend.quant.formats import BY_NAME

# byte offsets of each format's fp16 fields (d, and dmin/m where it has one)
SCALE_FIELDS = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,), "Q2_K": (80, 82),
                "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,), "IQ2_XXS": (0,), "IQ2_XS": (0,),
                "IQ2_S": (0,), "IQ3_XXS": (0,), "IQ3_S": (0,), "IQ1_S": (0,), "IQ4_NL": (0,), "IQ4_XS": (0,)}
# d sized so that weights land near 0.1 (the IQ types: their largest grid value times a middling scale)
K_SCALE = {"Q2_K": 0.005, "Q3_K": 0.002, "Q4_K": 0.0003, "Q5_K": 0.00015, "Q6_K": 0.00008, "IQ2_XXS": 0.0006,
           "IQ2_XS": 0.0006, "IQ2_S": 0.0006, "IQ3_XXS": 0.0006, "IQ3_S": 0.0008, "IQ1_S": 0.012, "IQ1_M": 0.012,
           "IQ4_NL": 0.0008, "IQ4_XS": 0.00005}
GGUF_QUANTIZES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "TQ1_0", "TQ2_0", "MXFP4")


def random_raw(name: str, rows: int, cols: int, seed: int = 0, lead: tuple[int, ...] = ()) -> np.ndarray:
    """uint8 [*lead, rows, row_bytes] of the format."""
    rng = np.random.default_rng(seed)
    if name in GGUF_QUANTIZES:
        w = rng.standard_normal((*lead, rows, cols)).astype(np.float32) * 0.1
        return quantize(w, getattr(T, name))
    # types we do not compute on (NVFP4): gguf-py's block sizes, every byte random
    block, block_bytes = (BY_NAME[name].block, BY_NAME[name].block_bytes) if name in BY_NAME \
        else GGML_QUANT_SIZES[getattr(T, name)]
    raw = rng.integers(0, 256, size=(*lead, rows, cols // block, block_bytes), dtype=np.uint8)
    for i, offset in enumerate(SCALE_FIELDS.get(name, ())):
        # d sized so that q times the sub-block scale lands near 0.1; mins a little smaller
        scale = rng.uniform(0.5, 1.5, size=raw.shape[:-1]) * K_SCALE[name] * (1.0 if i == 0 else 0.5)
        raw[..., offset:offset + 2] = scale.astype(np.float16)[..., None].view(np.uint8)
    if name == "IQ1_M":  # d's 16 bits are the top nibbles of the four scale words at 48..55, low nibble first
        d = (rng.uniform(0.5, 1.5, size=raw.shape[:-1]) * K_SCALE[name]).astype(np.float16).view(np.uint16)
        words = raw[..., 48:56].copy().view(np.uint16)
        for w in range(4):
            words[..., w] = (words[..., w] & 0x0FFF) | (((d >> (4 * w)) & 0xF) << 12)
        raw[..., 48:56] = words.view(np.uint8)
    return raw.reshape(*lead, rows, -1)


def gguf_dequant(raw: np.ndarray, name: str) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(dequantize(raw, getattr(T, name)), dtype=np.float32))
