"""GGUF blocks repacked at load for our CPU kernel (cpu_kernel.c), and the calls into it.

The kernel reads each weight as fma(q, scale, offset) in fp32 from small integer codes (4 bits for the
4-bit and 2/3-bit formats, 8 bits for the 5-, 6- and 8-bit ones and for the grid values of the other codebook
formats, IQ1-IQ3, TQ*) with one scale and offset per group of 32 weights (16 for Q2_K, Q3_K, Q6_K, IQ2_XS, IQ2_S
and IQ1_M): formats.decode's affine form, so the weights are gguf-py's dequantize bit
for bit, and x, the products and the sums stay fp32. The formats of a 16-value table (IQ4_NL, IQ4_XS, MXFP4) keep
the values' 4-bit places in it and the kernels look the values up (a byte shuffle, or the vpermps the 4-bit codes
take anyway): 4.5 bits a weight, not 8.5 (TABLES). Weight rows are interleaved 16 at a time (each k's 16
codes together), so that one decoded vector of weights meets up to 8 rows of x, register-blocked, with no
horizontal sums: one loop for decode steps, batches and prefill chunks, whose arithmetic for a row is the same
whatever the number of rows (batch-invariant). Scales are kept in fp16 where that is exact (every format with
fp16 block scales: Q4_x, Q5_x, Q8_0), so Q4_1 reads 5 bits a weight, as in the file; the K-quants' composed
scales (an fp16 d times a 6- or 8-bit integer: exact in fp32, not in fp16) are kept as their parts, each
superblock's fp16 d and each group's int8, multiplied in the kernel (parts_of): Q4_K 4.625 bits a weight (the
file's 4.5; fp32 scales took 6), Q6_K 8.56 (10). A Mixtral-layout Q4_K_M file of 74 MB packs into 84 MB (104
with fp32 scales); the int8 path decodes 11-15% faster for it, the fp32 one (bound by its arithmetic) the same.

A bfloat16 engine (arithmetic.products) on a CPU with AMX tiles stores the codes in the tiles' pair order instead
(pair_order), and every matmul multiplies in bf16 on the tiles, summing in fp32: up to 16 rows fed the codes
themselves (cpu_amx_codes.c: faster than fp32 from one row, and a verification row nearly free), more from weights
rounded to bf16 (cpu_amx.c). Without AMX a bfloat16 engine keeps this layout and fp32.

An engine with 8-bit activations (activations="int8", arithmetic.products) stores the codes four k's to a 32-bit lane
(quad_order), and every matmul quantizes x's rows per group to int8 and sums codes times them in int32
(cpu_int8.c): llama.cpp's arithmetic, 4x the multiply-adds of fp32 an instruction with AVX-512 VNNI. Where the build
has VNNI, an fp32 engine (and a bfloat16 one's layers off the AMX tiles) stores the same quads, order "digits", and
each matmul takes x's rows in three 8-bit digits per group instead (cpu_int8_rows.c): fp32's precision, exact integer
sums, 1.5-1.8x the fp32 kernel's decode.

The kernel is compiled at first use (backend/kernels/native.py). Without it, quantized layers take the
reference path (dequantize, then matmul); SCRIPTORIUM_QUANT_CPU=reference asks for that path alone.
"""

import os
from dataclasses import dataclass

import torch

from backend.kernels import native
from backend.quant.codebooks import table_values
from backend.quant.formats import Format, composed, decode, decode_parts

# Formats whose q fits 4 bits once shifted by `lo` (so q4 = q - lo, offset + lo * scale folded in).
_FOUR_BIT_LO = {"Q4_0": -8, "Q4_1": 0, "Q4_K": 0, "Q2_K": 0, "Q3_K": -4}
# Formats whose q is one of a table's 16 values: kept as its 4-bit index, bits TABLE_BITS + the table's place in
# TABLES, looked up in the kernels (cpu_exports.h; their C tables are these, the tests compare)
TABLES = ("IQ4_NL", "MXFP4")
TABLE_BITS = 16
_TABLE_OF = {"IQ4_NL": "IQ4_NL", "IQ4_XS": "IQ4_NL", "MXFP4": "MXFP4"}
CODE_BITS = {4: 4, 5: 8, 6: 6, 7: 8, 8: 8, TABLE_BITS: 4, TABLE_BITS + 1: 4}  # a layout's bits -> a code's in `codes`


PANEL = 16  # weight rows interleaved
TILE_PANELS = 4  # the most panels a tile of the kernel reads at once: rows are padded to whole groups of them


@dataclass(frozen=True)
class Layout:
    bits: int  # 4, 8 or a table's, TABLE_BITS + t (in pairs 4, 7 or 8, paired_bits's; in quads quad_bits's)
    group: int  # weights per scale: 16 or 32
    scale_kind: int  # how scales (and offsets) are stored: SCALES_FP32, SCALES_FP16, or the groups a superblock of
    # a K-quant's parts (parts_of)
    offsets: bool
    # where the codes lie: "panels" (pack's, the fp32 kernel's), "pairs" (AMX tiles' order, pair_order: every product
    # bf16's, on the tiles), "quads" (quad_order: every product int8 codes times x quantized to int8) or "digits"
    # (quad_order too, x taken in three 8-bit digits: 24 bits a group, fp32's precision; cpu_int8_rows.c)
    order: str = "panels"

    @property
    def order_code(self) -> int:  # qmm's `order`
        return ORDERS.index(self.order)


ORDERS = ("panels", "pairs", "quads", "digits")
SCALES_FP32, SCALES_FP16 = 0, 1  # scale_kind; a larger one is the groups of a superblock (cpu_kernel.h)


def enabled() -> bool:
    return os.environ.get("SCRIPTORIUM_QUANT_CPU", "native") != "reference" and native.enabled()


def pack(raw: torch.Tensor, fmt: Format, cols: int, kind: int | None = None
         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, Layout]:
    """Blocks [rows, row_bytes] -> codes [panels, cols, 16 * bits / 8] uint8, scales and offsets, and the layout.
    Scales and offsets are per panel, group and row: fp16 where that is exact (raw int16 bits), else for the
    K-quants their parts (per superblock the rows' fp16 d and each group's int8 multipliers, raw bytes), else fp32
    (raw int32 bits); raw integers, so that module.to(dtype) leaves them alone. kind: SCALES_FP32 to choose fp32
    whatever the values (an expert stack keeps one kind for all its experts).
    Rows are padded with zero weights to whole groups of 4 panels (64 rows), which a tile of the kernel may read at
    once."""
    rows = raw.shape[0]
    parts = decode_parts(raw, fmt)  # the K-quants' (their scales' parts kept, below), decoded once
    q, scale, offset = decode(raw, fmt) if parts is None else composed(parts)
    q = q.view(rows, cols).to(torch.int16)
    scale = scale.reshape(rows, -1)
    offset = offset.reshape(rows, -1) if offset is not None else None
    lo, table = _FOUR_BIT_LO.get(fmt.name), _TABLE_OF.get(fmt.name)
    if table is not None:
        q = _indices(q, table)
    if lo is not None and lo:  # q * s + o = (q - lo) * s + (o + lo * s); exact, as lo * s is and their sum is a weight
        offset = (offset if offset is not None else 0) + lo * scale
        q = q - lo
    pad = -rows % (PANEL * TILE_PANELS)
    panels = (rows + pad) // PANEL

    def interleaved(t: torch.Tensor) -> torch.Tensor:  # [rows, n] -> [panels, n, 16], padding rows zero
        t = torch.cat([t, t.new_zeros(pad, t.shape[1])]) if pad else t
        return t.view(panels, PANEL, -1).transpose(1, 2).contiguous()

    group = cols // scale.shape[1]
    split = parts_of(parts, fmt, scale, offset, lo or 0) if kind is None and parts is not None else None
    if split is not None:
        def stored(t):
            if t is None:
                return None
            d, n = t  # [rows, superblocks], [rows, groups]; kind: groups a superblock
            d = interleaved(d.half().view(torch.int16)).view(torch.uint8)  # [panels, superblocks, 32]
            n = interleaved(n.to(torch.int8).view(torch.uint8)).view(panels, d.shape[1], kind * PANEL)
            return torch.cat([d, n], dim=2).contiguous()
        kind, scale, offset = split[0], split[1], split[2]
    else:
        if kind is None:
            kind = SCALES_FP16 if all(t is None or torch.equal(t.half().float(), t) for t in (scale, offset)) \
                else SCALES_FP32

        def stored(t):
            if t is None:
                return None
            t = interleaved(t)
            return t.half().view(torch.int16) if kind == SCALES_FP16 else t.float().view(torch.int32)

    codes = interleaved(q)  # [panels, cols, 16]
    if lo is not None or table is not None:  # byte j: row j's code, then row j + 8's in the high nibble
        codes = (codes[..., :8] | (codes[..., 8:] << 4)).to(torch.uint8)
    else:
        codes = codes.to(torch.int8).view(torch.uint8)
    bits = 4 if lo is not None else 8 if table is None else TABLE_BITS + TABLES.index(table)
    layout = Layout(bits, group, kind, offset is not None)
    return codes.contiguous(), stored(scale), stored(offset), layout


def _indices(q: torch.Tensor, table: str) -> torch.Tensor:
    """A table's values -> their places in it (MXFP4's two zeros, +0 and -0 in the format and both 0 as gguf-py
    decodes them: the first)."""
    values = table_values(table, q.device).to(torch.int64) + 128
    inverse = torch.full((256,), -1, dtype=torch.int16, device=q.device)
    inverse[values.flip(0)] = torch.arange(15, -1, -1, dtype=torch.int16, device=q.device)  # the first place wins
    index = inverse[(q + 128).to(torch.int32)]
    if int(index.min()) < 0:
        raise ValueError(f"a weight that is none of {table}'s values")
    return index


def tabled(bits: int) -> bool:
    """Whether codes of these bits are indices into a table (TABLES)."""
    return bits >= TABLE_BITS


def untabled(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """pack's 4-bit indices into a table ([panels, K, 8], bits TABLE_BITS + t) as pack's 8-bit codes of their values
    ([panels, K, 16]): for the kernels that look up no table (AMX tiles', pair_order)."""
    values = table_values(TABLES[bits - TABLE_BITS], codes.device)
    return values[torch.cat([codes & 15, codes >> 4], dim=-1).long()].view(torch.uint8)  # byte j: rows j and j + 8


def parts_of(parts: tuple[torch.Tensor, ...], fmt: Format, scale: torch.Tensor, offset: torch.Tensor | None,
             lo: int) -> tuple[int, tuple, tuple | None] | None:
    """(kind, (d, n) of the scales, (d, n) of the offsets or None) where every scale (and offset) of these rows is
    exactly its superblock's fp16 d times an int8 n (parts: a K-quant's own, formats.decode_parts), else None (an
    fp16 d of inf or NaN, a multiplier past int8)."""
    rows = scale.shape[0]
    _, d, sc, dmin, mn = parts
    per = fmt.block // fmt.group  # groups a superblock
    pairs = [(d.view(rows, -1), sc.view(rows, -1).to(torch.int32))]
    if dmin is not None:
        pairs.append((-dmin.view(rows, -1), mn.view(rows, -1).to(torch.int32)))
    elif offset is not None:  # only lo's: lo * scale, as (lo * d) * n (a power of two times an fp16: exact)
        pairs.append((lo * pairs[0][0], pairs[0][1]))
    for (dd, n), value in zip(pairs, (scale, offset)):
        rebuilt = dd.repeat_interleave(per, dim=1) * n.float()
        if n.min() < -128 or n.max() > 127 or not torch.equal(rebuilt, value):  # (a zero's sign aside)
            return None
    return per, pairs[0], pairs[1] if len(pairs) > 1 else None


def paired_bits(codes: list[torch.Tensor], bits: int) -> int:
    """The bits of pack's codes (of one matrix or a stack's) in AMX tiles' order: 4-bit stay 4; 8-bit codes take 7
    where every q fits -64 .. 63 (q + 64: one tile product a group), else 8 (q + 128: two, cpu_amx_codes.c)."""
    if bits == 4:
        return 4
    q = [c.view(torch.int8) for c in codes if c.numel()]
    return 7 if all(int(c.min()) >= -64 and int(c.max()) <= 63 for c in q) else 8


def pair_order(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """pack's codes in AMX tiles' order, for cpu_amx_codes.c (bits: paired_bits's). A weight tile's row r holds
    k = 2r and 2r + 1 of the panel's 16 rows, word i column i // 2 at k = 2r + i % 2. 4-bit codes [panels, K, 8]
    -> [panels, K / 4, 32], 32 bytes for rows 2c (low nibbles) and 2c + 1 (high); 8-bit codes [panels, K, 16]
    -> bytes [panels, K / 2, 32], a row each: q + 64 (7) or q + 128 (8). Never a table's codes (untabled first)."""
    panels, cols = codes.shape[0], codes.shape[1]
    if codes.shape[2] * 8 != PANEL * (4 if bits == 4 else 8):
        raise ValueError(f"codes of {codes.shape[2] * 8 // PANEL} bits in pairs of bits {bits}")
    if bits == 4:
        q = torch.cat([codes & 15, codes >> 4], dim=-1)  # [panels, K, 16]: byte j held rows j and j + 8
    else:
        q = codes.view(torch.int8).to(torch.int16) + (64 if bits == 7 else 128)
    rows = q.view(panels, cols // 2, 2, PANEL).transpose(2, 3).reshape(panels, cols // 2, 2 * PANEL)
    if bits == 4:
        rows = rows.view(panels, cols // 4, 2, 2 * PANEL)
        rows = rows[:, :, 0] | (rows[:, :, 1] << 4)
    return rows.to(torch.uint8).contiguous()


def quad_bits(codes: list[torch.Tensor], bits: int) -> int:
    """The bits of pack's codes (of one matrix or a stack's) in quad order: 4-bit (and a table's) stay; 8-bit take 6 where
    every q fits -32 .. 31 (Q6_K, Q5_*: a weight in 6 bits, not 8), else 5 where every q fits -64 .. 63 (IQ3_XXS's
    and IQ2's grids: bytes as 7's, which AVX2 multiplies as q + 64, unsigned, with no sign step), else 7 where no q is
    -128 (AVX2 then multiplies q by x's sign and |x| with no 16-bit sum saturating, cpu_int8.c), else 8."""
    if bits == 4 or tabled(bits):
        return bits
    q = [c.view(torch.int8) for c in codes if c.numel()]
    if all(int(c.min()) >= -32 and int(c.max()) <= 31 for c in q):
        return 6
    if all(int(c.min()) >= -64 and int(c.max()) <= 63 for c in q):
        return 5
    return 7 if all(int(c.min()) > -128 for c in q) else 8


def quad_order(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """pack's codes four k's to a 32-bit lane, for cpu_int8.c (bits: quad_bits's). Per panel of 16 rows:
    4-bit (and a table's): 64 bytes for each 8 k's, byte 4r + i holding row r's q at k + i in its low nibble and at
    k + 4 + i in its high one: [panels, K, 8] -> [panels, K / 8, 64].
    6-bit (u = q + 32, 0 .. 63): 192 bytes for each 16 k's: their low 4 bits as two 4-bit units (k .. k + 7, then
    k + 8 .. k + 15), then 64 bytes of their high 2 bits, byte 4r + i holding those of k + i, k + 4 + i, k + 8 + i
    and k + 12 + i from its low bits up: [panels, K, 16] -> [panels, K / 16, 192].
    5, 7 or 8-bit: 64 bytes for each 4 k's, byte 4r + i row r's q at k + i plus 128: [panels, K, 16] -> [panels,
    K / 4, 64]."""
    panels, cols = codes.shape[0], codes.shape[1]
    if bits == 4 or tabled(bits):
        return _nibble_quads(torch.cat([codes & 15, codes >> 4], dim=-1))  # byte j held rows j and j + 8
    if bits == 6:
        u = (codes.view(torch.int8).to(torch.int16) + 32).to(torch.uint8)  # [panels, K, 16]
        low = _nibble_quads(u & 15).view(panels, cols // 16, 128)
        high = (u >> 4).view(panels, cols // 16, 4, 4, PANEL).permute(0, 1, 4, 3, 2)  # [.., row, i, quarter]
        high = high[..., 0] | (high[..., 1] << 2) | (high[..., 2] << 4) | (high[..., 3] << 6)
        return torch.cat([low, high.reshape(panels, cols // 16, 64)], dim=-1).contiguous()
    q = (codes.view(torch.int8).to(torch.int16) + 128).to(torch.uint8)
    return q.view(panels, cols // 4, 4, PANEL).transpose(2, 3).reshape(panels, cols // 4, 64).contiguous()


def _nibble_quads(q: torch.Tensor) -> torch.Tensor:
    """[panels, K, 16] values below 16 -> [panels, K / 8, 64]: byte 4r + i, row r's at k + i and k + 4 + i."""
    panels, cols = q.shape[0], q.shape[1]
    q = q.view(panels, cols // 8, 2, 4, PANEL).permute(0, 1, 2, 4, 3)  # [.., half, row, i]: k = 8j + 4 half + i
    return (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(panels, cols // 8, 64).contiguous()


def matmul(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor | None,
           layout: Layout, rows: int) -> torch.Tensor:
    """x [..., K] -> [..., rows] in x's dtype."""
    lib = native.library()
    cols = x.shape[-1]
    x2 = x if x.dim() == 2 else x.reshape(-1, cols)
    if x2.dtype != torch.float32 or not x2.is_contiguous():
        x2 = x2.float().contiguous()
    m = x2.shape[0]
    y = torch.empty(m, rows)
    lib.qmm(x2.data_ptr(), m, codes.data_ptr(), scales.data_ptr(), offsets.data_ptr() if offsets is not None else None,
            rows, cols, layout.bits, layout.group, layout.scale_kind, layout.order_code, y.data_ptr(), rows,
            torch.get_num_threads())
    if y.dtype != x.dtype:
        y = y.to(x.dtype)
    return y if x.dim() == 2 else y.reshape(*x.shape[:-1], rows)

