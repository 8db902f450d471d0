"""Multi-head latent attention over a paged latent cache: torch and our C decode kernel on the CPU, the Triton
decode kernel (mla_triton.py) for CUDA's decode rows.

A layer's cache holds one row a token, [num_blocks, block_size, 1, kv_lora_rank + rope_dim]: the normed compressed
kv, then the rotated key of the rotary part (layer_spec.AttentionSpec.block_shapes). kv_b_proj's weight
[heads * (nope + v), kv_lora_rank] expands a latent into each head's non-rotary key (W_UK) and value (W_UV).

Decode rows attend in the latent space: the query's non-rotary part is taken through W_UK (q_nope . W_UK c equals
q_nope . k_nope), every head then attends to the same rows as one kv head of width kv_lora_rank + rope_dim, the
values being the rows' first kv_lora_rank columns, and W_UV maps the attended latent to each head's value: on
the CPU that is attention.decode_attention's rows (our C kernel) over the cache as one kv head whose rows are the
keys and the values alike. Prompt chunks may expand the latents into keys and values instead (decompressed).
Measured at DeepSeek-V2-Lite's widths (16 heads, kv_lora 512, rope 64, nope and v 128; 2 busy CPU cores, ms):
rows/positions 1/1024: 46 latent, 114 expanded; 16/1024: 30 / 181; 64/512: 68 / 121; 128/4096: 444 / 534;
256/512: 169 / 205; 256/2048: 428 / 373; 512/2048: 1300 / 725. So decode rows, a verification run's rows (so that
greedy speculation keeps plain decoding's tokens) and chunks of up to ABSORBED_ROWS rows attend in the latent
space on the CPU; longer chunks, and every chunk on CUDA, are expanded.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from backend.kernels import native, use_triton
from backend.kernels.attention import AttentionMetadata, decode_attention
from backend.kernels.step_paths import C, rows_kernel

# Decode rows of at most this many go through our one C call (cpu_mla.c, which reads each head's weights once for
# all its rows with vector dot products); more rows, a prompt chunk's, are faster in torch's batched matmuls
C_ROWS = 16
BLOCK = 32  # columns a scale of the int8 weights covers (cpu_mla.c's BLOCK)


@dataclass
class HeadWeights:
    """kv_b's halves a matrix per head as cpu_mla.c reads them: W_UK [heads, lora, nope] and W_UV [heads, v, lora],
    each as int8 with a scale per BLOCK columns where those hold its weights exactly (a GGUF's Q8_0 attn_k_b and
    attn_v_b: a quarter of fp32's bytes a token), else fp32 (W_UV then a view of kv_b). A layer holds one, made at
    its first decode step from kv_b at `source` (its address) and again should kv_b move."""

    source: int = 0
    uk: torch.Tensor | None = None
    uk_scales: torch.Tensor | None = None
    uv: torch.Tensor | None = None
    uv_scales: torch.Tensor | None = None

    def refresh(self, w_kv_b: torch.Tensor, heads: int, nope: int) -> "HeadWeights":
        if self.source != w_kv_b.data_ptr():
            w = w_kv_b.detach().view(heads, -1, w_kv_b.shape[1])
            self.uk, self.uk_scales = exact_int8(w[:, :nope].transpose(1, 2).contiguous())
            self.uv, self.uv_scales = exact_int8(w[:, nope:])
            self.source = w_kv_b.data_ptr()
        return self

    def hold_at_load(self, w_kv_b: torch.Tensor, heads: int, nope: int, rope: int) -> None:
        """Made with the model where the C rows will read kv_b (fp32 on the CPU with our kernels, over a CPU cache of
        any kind), not at the first decode step: what a loaded model holds (weight_sizes.module_bytes, which the
        registry and the ready log count) then includes them, and the CPU's KV budget, sized after the load, sees
        the memory they take."""
        q_nope, q_pe = w_kv_b.new_empty(1, heads, nope), w_kv_b.new_empty(1, heads, rope)
        if _c_reads(q_nope, q_pe, w_kv_b.new_empty(0, 1, 1, w_kv_b.shape[1] + rope), w_kv_b):
            self.refresh(w_kv_b, heads, nope)


def exact_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(codes [..., cols] int8, scales [..., cols / BLOCK] fp32) whose products are w's every element (a Q8_0
    tensor's blocks as dequantized: each block's largest magnitude 127 times its scale), or (w, None) where no such
    pair is exact."""
    blocks = w.unflatten(-1, (-1, BLOCK))
    scales = blocks.abs().amax(-1) / 127
    codes = torch.round(blocks / torch.where(scales == 0, 1.0, scales)[..., None])
    if not torch.equal(codes * scales[..., None], blocks):
        return w, None
    return codes.to(torch.int8).flatten(-2).contiguous(), scales.contiguous()


def store_latent(rows: torch.Tensor, k_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write each token's latent row [T, kv_lora_rank + rope_dim] into its cache slot (none for a CUDA graph's
    padding rows, whose slot is -1)."""
    if use_triton(rows):
        from backend.kernels import triton_kernels

        # the key/value store with the latent as both: the same row written twice, skipped for padding rows
        return triton_kernels.store_kv(rows[:, None], rows[:, None], k_cache, k_cache, slot_mapping)
    k_cache.view(-1, k_cache.shape[-1]).index_copy_(0, slot_mapping, rows.to(k_cache.dtype))


def absorbed_attention(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    k_cache: torch.Tensor,
    w_kv_b: torch.Tensor,
    tables: torch.Tensor,
    lens: torch.Tensor,
    scale: float,
    held: HeadWeights | None = None,
) -> torch.Tensor:
    """Each row as one decoding token attending to the first lens[i] positions of its block table, in the latent
    space. q_nope [N, H, nope], q_pe [N, H, rope], w_kv_b [H * (nope + v), kv_lora], tables [N, blocks],
    lens [N] -> [N, H, v]. held: the layer's HeadWeights, for our C kernel (None: the torch path)."""
    n, heads, nope = q_nope.shape
    kv_lora = k_cache.shape[-1] - q_pe.shape[-1]
    if held is not None and n <= C_ROWS and _c_reads(q_nope, q_pe, k_cache, w_kv_b):
        return _c_rows(q_nope, q_pe, k_cache, held.refresh(w_kv_b, heads, nope), tables, lens, scale)
    w = w_kv_b.view(heads, -1, kv_lora)
    w_uk, w_uv = w[:, :nope], w[:, nope:]
    # batched over heads; the weight's head slices are read in place (einsum copies them)
    q_latent = torch.bmm(q_nope.transpose(0, 1), w_uk.to(q_nope.dtype)).transpose(0, 1)
    q = torch.cat([q_latent, q_pe], dim=-1)  # [N, H, lora + rope]
    if use_triton(q):
        from backend.kernels import mla_triton

        latent = mla_triton.latent_decode(q, k_cache, tables, lens, scale, kv_lora)
        return _values(latent, w_uv)
    # One kv head of kv_lora + rope, its rows the keys and the values alike: the first kv_lora columns of what a
    # head attends are its latent (the rest, the rotary keys' mix, is dropped). attention.py's decode rows: our C
    # kernel on the CPU, reading the cache in place; torch's attention elsewhere.
    latent = decode_attention(q, k_cache, k_cache, tables, lens, scale)[..., :kv_lora]
    return _values(latent, w_uv)


def _c_reads(q_nope: torch.Tensor, q_pe: torch.Tensor, k_cache: torch.Tensor, w_kv_b: torch.Tensor) -> bool:
    """Whether cpu_mla.c runs these rows: fp32 on the CPU, widths its vectors take."""
    nope, rope = q_nope.shape[-1], q_pe.shape[-1]
    lora, v = k_cache.shape[-1] - rope, w_kv_b.shape[0] // q_nope.shape[1] - nope
    return (
        _latent_rows_kernel(q_nope, k_cache) == C
        and native.usable(q_pe, w_kv_b)
        and q_nope.stride(-1) == 1
        and q_pe.stride(-1) == 1
        and c_rows_fit(nope, rope, lora, v)
    )


def c_rows_fit(nope: int, rope: int, lora: int, v: int) -> bool:
    """Whether cpu_mla.c's vectors take these widths (the one-call step asks too: models/cpu_decoder.py)."""
    return nope % BLOCK == 0 and lora % BLOCK == 0 and v % BLOCK == 0 and rope % 8 == 0


def _c_rows(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    k_cache: torch.Tensor,
    w: HeadWeights,
    tables: torch.Tensor,
    lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """absorbed_attention's rows in one call of cpu_mla.c."""
    n, heads, nope = q_nope.shape
    rope, v = q_pe.shape[-1], w.uv.shape[1]
    out = q_nope.new_empty(n, heads, v)
    tables, lens = tables.contiguous() if tables.stride(-1) != 1 else tables, lens.contiguous()

    def scales(s: torch.Tensor | None) -> int | None:
        return None if s is None else s.data_ptr()

    done = native.library().mla_decode_rows(
        q_nope.data_ptr(), q_nope.stride(0), q_nope.stride(1), q_pe.data_ptr(), q_pe.stride(0), q_pe.stride(1),
        n, heads, nope, rope, k_cache.shape[-1] - rope, v,
        w.uk.data_ptr(), scales(w.uk_scales), w.uk.stride(0), w.uv.data_ptr(), scales(w.uv_scales), w.uv.stride(0),
        k_cache.data_ptr(), native.KV_KINDS[k_cache.dtype], k_cache.shape[1], tables.data_ptr(), tables.stride(0),
        lens.data_ptr(), scale, tables.shape[1] * k_cache.shape[1], out.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    if not done:
        raise MemoryError(f"no memory for the scratch of {n} latent attention rows: lower --max-num-seqs")
    return out


def _values(latent: torch.Tensor, w_uv: torch.Tensor) -> torch.Tensor:
    """The attended latents [N, H, lora] through W_UV [H, v, lora]: each head's value [N, H, v]."""
    return torch.bmm(latent.transpose(0, 1), w_uv.to(latent.dtype).transpose(1, 2)).transpose(0, 1)


def decompressed_attention(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    k_cache: torch.Tensor,
    w_kv_b: torch.Tensor,
    table: torch.Tensor,
    context_len: int,
    scale: float,
) -> torch.Tensor:
    """Causal attention of a chunk of S queries, the last S of context_len positions in the cache, with the
    latents expanded into every head's keys and values. q_nope [S, H, nope], q_pe [S, H, rope] -> [S, H, v]."""
    s, heads, nope = q_nope.shape
    rope = q_pe.shape[-1]
    kv_lora = k_cache.shape[-1] - rope
    block_size = k_cache.shape[1]
    blocks = table[: (context_len + block_size - 1) // block_size]
    rows = k_cache.index_select(0, blocks).to(q_nope.dtype).view(-1, k_cache.shape[-1])[:context_len]
    kv = F.linear(rows[:, :kv_lora], w_kv_b.to(rows.dtype)).view(context_len, heads, -1)  # [C, H, nope + v]
    k = torch.cat([kv[..., :nope], rows[:, None, kv_lora:].expand(-1, heads, -1)], dim=-1)
    v = kv[..., nope:]
    q = torch.cat([q_nope, q_pe], dim=-1)
    mask = None
    if s != context_len:
        q_pos = torch.arange(context_len - s, context_len, device=q.device)[:, None]
        mask = (torch.arange(context_len, device=q.device)[None, :] <= q_pos)[None]
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1),
        k.transpose(0, 1),
        v.transpose(0, 1),
        attn_mask=mask,
        is_causal=mask is None,
        scale=scale,
    )
    return out.transpose(0, 1)


# A prompt chunk of at most this many rows attends in the latent space where our C kernel runs the rows (measured
# above: faster up to ~200 rows); longer ones, and every chunk elsewhere, expand the latents
ABSORBED_ROWS = 128


def _latent_rows_kernel(q_nope: torch.Tensor, k_cache: torch.Tensor) -> str:
    """The table's kernel (step_paths.rows_kernel: C or TORCH) for the rows absorbed_attention hands
    attention.decode_attention: queries in the latent space [rows, heads, kv_lora + rope], contiguous, over the
    cache as their keys and values alike."""
    return rows_kernel(q_nope.new_empty(0, q_nope.shape[1], k_cache.shape[-1]), k_cache, k_cache)


def mla_attention(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    k_cache: torch.Tensor,
    w_kv_b: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    held: HeadWeights | None = None,
) -> torch.Tensor:
    """A mixed batch (decode rows first, then prompt chunks), its latents already stored -> [T, H, v]. held: the
    layer's HeadWeights for our C kernel's decode rows."""
    n = meta.num_decode
    v_dim = w_kv_b.shape[0] // q_nope.shape[1] - q_nope.shape[2]
    out = q_nope.new_empty(*q_nope.shape[:2], v_dim)
    if n:
        out[:n] = absorbed_attention(
            q_nope[:n],
            q_pe[:n],
            k_cache,
            w_kv_b,
            meta.decode_block_tables,
            meta.decode_context_lens,
            scale,
            held,
        )
    for i, chunk in enumerate(meta.prefills):
        rows = slice(chunk.start, chunk.end)
        table = chunk.block_table if chunk.block_table is not None else meta.prefill_block_tables[i]
        table = table.to(q_nope.device)
        s = chunk.end - chunk.start
        # rows at their positions where our C kernel reads them (not gathering the context once a row)
        if chunk.verifies or (s <= ABSORBED_ROWS and _latent_rows_kernel(q_nope, k_cache) == C):
            lens = torch.arange(chunk.context_len - s + 1, chunk.context_len + 1, device=q_nope.device)
            out[rows] = absorbed_attention(
                q_nope[rows], q_pe[rows], k_cache, w_kv_b, table.expand(s, -1), lens, scale, held
            )
        else:
            out[rows] = decompressed_attention(
                q_nope[rows], q_pe[rows], k_cache, w_kv_b, table, chunk.context_len, scale
            )
    return out
