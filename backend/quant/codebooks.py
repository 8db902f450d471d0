"""GGUF's codebook and ternary formats (IQ*, MXFP4, TQ*) decoded in torch to the affine form of formats.decode.

Every weight of these formats is a small signed integer (a grid entry times its sign, a table's value, a ternary
digit) times its group's scale, so they take the same q * scale as the linear formats, with no offset: IQ1_S/IQ1_M's
grid value plus a delta of +-1/8 is carried as 8 * value +- 1 times an eighth of the scale, which is the same
product (one rounding of the same real number) as gguf-py's dl * (value + delta). The scales are computed with
gguf-py's operations in its order, so dequantize is bit for bit gguf-py's. The grids and sign tables are gguf-py's
own data, read from it at first use.
"""

import functools

import torch

from backend.quant.block_bytes import bits, f16, nibbles, words


@functools.cache
def grid_values(name: str, device: torch.device) -> torch.Tensor:
    """gguf-py's grid of the type as int8 [entries, width]."""
    from gguf import quants

    cls = getattr(quants, name)
    cls.init_grid()
    return torch.from_numpy(cls.grid.reshape(cls.grid_shape)).to(torch.int8).to(device)


@functools.cache
def table_values(name: str, device: torch.device) -> torch.Tensor:
    """IQ4_NL's and MXFP4's 16 values as int8."""
    from gguf import quants

    return torch.tensor(getattr(quants, name).kvalues, dtype=torch.int8, device=device)


@functools.cache
def sign_patterns(device: torch.device) -> torch.Tensor:
    """The 128 sign patterns of 8 weights the IQ2/IQ3 types index (bit i set: weight i negative) as +-1 [128, 8]."""
    from gguf import quants

    patterns = torch.frombuffer(bytearray(quants.IQ2_XXS.ksigns), dtype=torch.uint8).to(device)
    negative = (patterns[:, None] >> torch.arange(8, dtype=torch.uint8, device=device)) & 1
    return (1 - 2 * negative.to(torch.int8)).to(torch.int8)


def _signs_of_bits(b: torch.Tensor) -> torch.Tensor:
    """[n, bytes] of sign bits (bit i of byte j: weight 8j + i negative) -> +-1 int8 [n, 8 * bytes]."""
    return (1 - 2 * bits(b, 8, 1, 1).to(torch.int8)).to(torch.int8)


def _on_grid(name: str, index: torch.Tensor) -> torch.Tensor:
    """Grid entries [n, k] -> their values int8 [n, k * width]."""
    return grid_values(name, index.device)[index].reshape(index.shape[0], -1)


def _iq2_scale(d: torch.Tensor, s: torch.Tensor, last: float) -> torch.Tensor:
    return d * (0.5 + s.float()) * last


def _iq2_xxs(b: torch.Tensor, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """IQ2_XXS and IQ3_XXS: d, then the grid indices, and per 32 weights a 32-bit word of four 7-bit sign indices and
    a 4-bit scale (after IQ2_XXS's indices of each 32 weights, after all of IQ3_XXS's)."""
    n, d = b.shape[0], f16(b[:, 0:2])
    if name == "IQ2_XXS":
        pairs = b[:, 2:66].reshape(n, 8, 8)
        index, aux = pairs[:, :, 0:4].reshape(n, 32), words(pairs[:, :, 4:8].reshape(n, 32), 32)
        scale = _iq2_scale(d, aux >> 28, 0.25)
    else:
        index, aux = b[:, 2:66], words(b[:, 66:98], 32)
        scale = _iq2_scale(d, aux >> 28, 0.5)
    sign_index = (aux[:, :, None] >> torch.tensor([0, 7, 14, 21], device=b.device)) & 0x7F
    signs = sign_patterns(b.device)[sign_index.reshape(n, -1)].reshape(n, -1)
    return _on_grid(name, index.long()) * signs, scale


def _iq2_xs(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """IQ2_XS: d, 32 16-bit words (a 9-bit grid index and a 7-bit sign index per 8 weights), 4-bit scales per 16."""
    n, d = b.shape[0], f16(b[:, 0:2])
    qs = words(b[:, 2:66], 16)
    signs = sign_patterns(b.device)[(qs >> 9).reshape(-1)].reshape(n, -1)
    return _on_grid("IQ2_XS", qs & 511) * signs, _iq2_scale(d, bits(b[:, 66:74], 2, 4, 1), 0.25)


def _iq2_s(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """IQ2_S: d, the grid indices' low bytes, sign bits, their 2 high bits, 4-bit scales per 16 weights."""
    d = f16(b[:, 0:2])
    index = b[:, 2:34].long() | (bits(b[:, 66:74], 4, 2, 1).long() << 8)
    q = _on_grid("IQ2_S", index) * _signs_of_bits(b[:, 34:66])
    return q, _iq2_scale(d, bits(b[:, 74:82], 2, 4, 1), 0.25)


def _iq3_s(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """IQ3_S: d, the grid indices' low bytes, their high bits, sign bits, 4-bit scales per 32 weights."""
    d = f16(b[:, 0:2])
    index = b[:, 2:66].long() | (bits(b[:, 66:74], 8, 1, 1).long() << 8)
    q = _on_grid("IQ3_S", index) * _signs_of_bits(b[:, 74:106])
    return q, d * (1 + 2 * bits(b[:, 106:110], 2, 4, 1)).float()


def _iq1(b: torch.Tensor, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """IQ1_S: d, the grid indices' low bytes, per 32 weights a 16-bit word of their 3 high bits each, a 3-bit scale
    and the delta's sign. IQ1_M: the low bytes, per 16 weights a byte of two (3 high bits and the delta's sign) for
    8 weights each, then four 16-bit words of 3-bit scales whose top 4 bits together make d."""
    n = b.shape[0]
    if name == "IQ1_S":
        d, qh = f16(b[:, 0:2]), words(b[:, 34:50], 16)
        high = (qh[:, :, None] >> torch.tensor([0, 3, 6, 9], device=b.device)) & 7
        index = b[:, 2:34].long() | (high.reshape(n, -1) << 8)
        dl = d * (2 * ((qh >> 12) & 7) + 1).float()
        negative = (qh >> 15).repeat_interleave(4, dim=1)  # per 8 weights
    else:
        sc = words(b[:, 48:56], 16)
        # d's bits: the top nibble of each word, the first word's lowest (disjoint: their sum is their union)
        d_bits = ((sc & 0xF000) >> torch.tensor([12, 8, 4, 0], device=b.device)).sum(dim=1)
        d = (d_bits - ((d_bits >> 15) << 16))[:, None].to(torch.int16).view(torch.float16).float()
        nib = bits(b[:, 32:48], 2, 4, 1).long()
        index = b[:, 0:32].long() | ((nib & 7) << 8)
        scales = (sc[:, :, None] >> torch.tensor([0, 3, 6, 9], device=b.device)) & 7
        dl = d * (2 * scales.reshape(n, -1) + 1).float()
        negative = nib >> 3
    delta = (1 - 2 * negative).to(torch.int8).repeat_interleave(8, dim=1)
    return 8 * _on_grid(name, index) + delta, dl * 0.125


def _ternary(b: torch.Tensor, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """TQ2_0: 2-bit digits then d. TQ1_0: base-3 digits, five to a byte (four to qh's), as the fraction of the byte
    times 3, then d."""
    n = b.shape[0]
    if name == "TQ2_0":
        digits, d = bits(b[:, 0:64], 4, 2, 32), f16(b[:, 64:66])
    else:
        powers = torch.tensor([1, 3, 9, 27, 81], dtype=torch.uint8, device=b.device)
        # uint8 products wrap, as the format means: each power of 3 shifts the next digit to the byte's top
        spans = ((0, 32, 5), (32, 48, 5), (48, 52, 4))
        packed = torch.cat(
            [(b[:, lo:hi, None] * powers[:k]).transpose(1, 2).reshape(n, -1) for lo, hi, k in spans], 1
        )
        digits, d = (packed.to(torch.int16) * 3) >> 8, f16(b[:, 52:54])
    return digits.to(torch.int8) - 1, d.expand(n, 8)  # one d per 256, written per 32 for the kernels


def decode_codebook(b: torch.Tensor, name: str) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Blocks [n, block_bytes] of a codebook or ternary type -> q [n, block] int8, scale [n, groups] fp32; None for
    the other types."""
    if name in ("IQ4_NL", "MXFP4"):
        q = table_values(name, b.device)[nibbles(b[:, 2 if name == "IQ4_NL" else 1 :], 16).long()]
        if name == "IQ4_NL":
            return q, f16(b[:, 0:2])
        e = b[:, 0:1].to(torch.int32)  # e8m0, as gguf-py halves it: 2^(e - 128)
        scale = torch.where(
            e < 2, torch.tensor(0x00200000, dtype=torch.int32, device=b.device) << e, (e - 1) << 23
        )
        return q, scale.view(torch.float32)
    if name in ("IQ2_XXS", "IQ3_XXS"):
        return _iq2_xxs(b, name)
    if name in ("IQ1_S", "IQ1_M"):
        return _iq1(b, name)
    if name in ("TQ1_0", "TQ2_0"):
        return _ternary(b, name)
    decoder = {"IQ2_XS": _iq2_xs, "IQ2_S": _iq2_s, "IQ3_S": _iq3_s}.get(name)
    return decoder(b) if decoder is not None else None


def iq4_xs_parts(b: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """IQ4_XS's blocks -> q [n, 256] int8, fp32 d [n, 1], the 6-bit scales less 32 [n, 8] (scale: d * them)."""
    n = b.shape[0]
    low = bits(b[:, 4:8], 2, 4, 1)
    high = (words(b[:, 2:4], 16) >> torch.arange(0, 16, 2, device=b.device)) & 3
    sc = (low.to(torch.int16) | (high.to(torch.int16) << 4)) - 32
    q = table_values("IQ4_NL", b.device)[nibbles(b[:, 8:136], 16).long()]
    return q.reshape(n, -1), f16(b[:, 0:2]), sc.to(torch.int8), None, None
