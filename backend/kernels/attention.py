"""Attention over a paged KV cache (torch reference).

The cache of one layer is a pair of tensors [num_blocks, block_size, num_kv_heads, head_dim];
token t of a sequence lives in block block_table[t // block_size] at offset t % block_size,
i.e. in slot block_table[t // block_size] * block_size + t % block_size.
"""

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from backend.kernels import native, use_triton
from backend.kernels.delta_rule import StateRows
from backend.kernels.step_paths import TRITON, C, attention_kernel, chunk_kernel, rows_kernel


@dataclass
class PrefillChunk:
    """A run of consecutive query tokens of one sequence (a prompt chunk), at token rows [start, end)."""

    start: int
    end: int
    context_len: int  # tokens in the cache once this chunk is written, the chunk included
    block_table: torch.Tensor | None  # [num_blocks_of_sequence]; the torch path's (None on CUDA)
    # It scores a greedy request's drafts: the torch path attends each row as a decode row (verify_attention),
    # so that speculation changes no token. Sampled requests need only the target's distribution: one chunk.
    verifies: bool = False


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens]: cache slot of each token in the batch
    # The first num_decode tokens each attend as a decoding token at their own position: one per sequence, or also
    # a verification run's rows and short prompt chunks (several of one sequence: step_paths.attends_as_decode).
    num_decode: int = 0
    decode_block_tables: torch.Tensor | None = None  # [num_decode, max_blocks], padded with 0
    decode_context_lens: torch.Tensor | None = None  # [num_decode]
    decode_uniform_len: int | None = None  # the torch path's: every decode row's context length, when all are equal
    prefills: list[PrefillChunk] = field(default_factory=list)
    # The same prompt chunks as tensors, for the one-launch CUDA kernel: query offsets [N+1] (rows counted
    # from the first prefill token), context lengths [N], block tables [N, max_blocks].
    prefill_cu_q: torch.Tensor | None = None
    prefill_context_lens: torch.Tensor | None = None
    prefill_block_tables: torch.Tensor | None = None
    prefill_max_len: int = 0
    # A hybrid model's: which linear-attention state each decode row and prompt chunk reads (engine/state_pool.py);
    # None without linear layers
    states: StateRows | None = None
    # What sliding-window layers read where they keep a pool of their own (engine/cache_groups.py): these fields
    # with that pool's slots and tables; None: every layer reads the fields above
    sliding: "AttentionMetadata | None" = None


def store_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Write key/value [num_tokens, num_kv_heads, head_dim] into their cache slots (rounded to the cache's dtype,
    where kv_cache_dtype made it narrower than the model's: to nearest even, as cpu_decoder.c stores them too)."""
    if use_triton(key):
        from backend.kernels import triton_kernels

        return triton_kernels.store_kv(key, value, k_cache, v_cache, slot_mapping)
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slot_mapping, key.to(k_cache.dtype))
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping, value.to(v_cache.dtype))


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
            scale: float, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q [B, Hq, S, D], k/v [B, Hkv, L, D], mask [B, 1, S, L] (True = attend) or None for plain causal (S == L)."""
    if sinks is not None:
        return _attend_with_sinks(q, k, v, mask, scale, sinks)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale,
                                          enable_gqa=q.shape[1] != k.shape[1])


def _attend_with_sinks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                       scale: float, sinks: torch.Tensor) -> torch.Tensor:
    """_attend with one learned logit a query head (sinks [Hq], gpt-oss's) in each softmax's denominator, as one
    more key every query attends: q carries sink / scale in an extra dimension that only that key reads (1 there,
    0 in every other key), and its value is zero. Through SDPA, whose fused kernel never holds a chunk's whole
    score matrix (a 2,048-token chunk over 8,192 positions, 16 heads: 0.1 GB where scores written out take 3 GB,
    measured)."""
    b, hq, s, d = q.shape
    n = k.shape[2]
    extra = (sinks.to(q.dtype) / scale).view(1, hq, 1, 1).expand(b, hq, s, 1)
    q = torch.cat([q, extra], dim=-1)
    k = F.pad(k, (0, 1, 0, 1))  # a dimension of zeros, then the sink's key
    k[:, :, n, d] = 1.0
    v = F.pad(v, (0, 1, 0, 1))  # the sink's value: zeros (and the padded dimension, dropped after)
    if mask is None:  # plain causal: the chunk is the whole context
        mask = torch.ones(s, n, dtype=torch.bool, device=q.device).tril()[None, None]
    mask = torch.cat([mask, mask.new_ones(*mask.shape[:-1], 1)], dim=-1)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=hq != k.shape[1])
    return out[..., :d]


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                     context_lens: torch.Tensor, scale: float, sliding_window: int | None = None,
                     uniform_len: int | None = None, sinks: torch.Tensor | None = None,
                     kernel: str | None = None) -> torch.Tensor:
    """One query token per sequence, attending to its whole context. q [B, Hq, D] -> [B, Hq, D].

    Slots past a sequence's end are read (block tables are padded) and masked out; the cache is
    zero-initialised so they always hold finite numbers. With uniform_len (every context that long, as a
    single sequence's always is) they are sliced off instead: no mask to build, a faster attention.
    sinks [Hq]: a learned logit a head in every softmax's denominator (gpt-oss), or None.
    kernel: C or TORCH as paged_attention found it (step_paths.rows_kernel); None: asked here.
    """
    if (kernel or rows_kernel(q, k_cache, v_cache)) == C:
        return _native_rows(q, k_cache, v_cache, block_tables, context_lens, scale, sliding_window, sinks)
    b, hq, d = q.shape
    hkv = k_cache.shape[2]
    blocks = block_tables.flatten()
    k = k_cache.index_select(0, blocks).to(q.dtype).view(b, -1, hkv, d).transpose(1, 2)
    v = v_cache.index_select(0, blocks).to(q.dtype).view(b, -1, hkv, d).transpose(1, 2)
    if uniform_len is not None and sliding_window is None and sinks is None:
        k, v = k[:, :, :uniform_len], v[:, :, :uniform_len]
        return F.scaled_dot_product_attention(q.unsqueeze(2), k, v, scale=scale,
                                              enable_gqa=hq != hkv).squeeze(2)
    pos = torch.arange(k.shape[2], device=q.device)
    mask = pos[None, :] < context_lens[:, None]
    if sliding_window is not None:
        mask &= pos[None, :] >= context_lens[:, None] - sliding_window
    return _attend(q.unsqueeze(2), k, v, mask[:, None, None, :], scale, sinks).squeeze(2)


def _native_rows(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
                 lens: torch.Tensor, scale: float, sliding_window: int | None,
                 sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Our C kernel (cpu_attention.c): each row of q as one sequence's decoding token, reading the cache in place."""
    out = q.new_empty(q.shape)
    rows, hq, d = q.shape
    sinks = sinks.float().contiguous() if sinks is not None else None  # held here while the kernel reads it
    native.library().decode_attention_rows(
        q.data_ptr(), q.stride(0), out.data_ptr(), rows, hq, k_cache.shape[2], d, k_cache.data_ptr(), v_cache.data_ptr(),
        native.KV_KINDS[k_cache.dtype], k_cache.shape[1], tables.data_ptr(), tables.stride(0), lens.data_ptr(), sliding_window or 0, scale,
        sinks.data_ptr() if sinks is not None else None, tables.shape[1] * k_cache.shape[1], torch.get_num_threads())
    return out


def _native_chunk(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, table: torch.Tensor,
                  context_len: int, scale: float, sliding_window: int | None,
                  sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Our C kernel (cpu_chunk_attention.c): a prompt chunk's rows, causal, reading the cache in place."""
    out = q.new_empty(q.shape)
    s, hq, d = q.shape
    sinks = sinks.float().contiguous() if sinks is not None else None  # held here while the kernel reads it
    table = table.to(torch.int64).contiguous()
    native.library().chunk_attention(
        q.data_ptr(), q.stride(0), out.data_ptr(), s, hq, k_cache.shape[2], d, k_cache.data_ptr(), v_cache.data_ptr(),
        native.KV_KINDS[k_cache.dtype], k_cache.shape[1], table.data_ptr(), context_len, sliding_window or 0, scale,
        sinks.data_ptr() if sinks is not None else None, torch.get_num_threads())
    return out


def prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                      context_len: int, scale: float, sliding_window: int | None = None,
                      sinks: torch.Tensor | None = None, kernel: str | None = None) -> torch.Tensor:
    """Causal attention of a chunk of S query tokens, the last S of a context already in the cache.

    q [S, Hq, D] -> [S, Hq, D]. Query i sits at position context_len - S + i.
    kernel: C or TORCH as paged_attention found it (step_paths.chunk_kernel decides); None: asked here.
    """
    if chunk_kernel(q, k_cache, v_cache, kernel) == C:
        return _native_chunk(q, k_cache, v_cache, block_table, context_len, scale, sliding_window, sinks)
    s, hq, d = q.shape
    hkv = k_cache.shape[2]
    block_size = k_cache.shape[1]
    num_blocks = (context_len + block_size - 1) // block_size
    # A window reads from its first query's reach on: the blocks before it are not gathered (a sliding group has
    # given them back: engine/cache_groups.py)
    first = max(0, context_len - s - sliding_window + 1) // block_size if sliding_window is not None else 0
    start = first * block_size
    blocks = block_table[first:num_blocks]
    k = k_cache.index_select(0, blocks).to(q.dtype).view(-1, hkv, d)[:context_len - start].transpose(0, 1)
    v = v_cache.index_select(0, blocks).to(q.dtype).view(-1, hkv, d)[:context_len - start].transpose(0, 1)
    mask = None  # plain causal: the chunk is the whole context
    if s != context_len or sliding_window is not None:
        q_pos = torch.arange(context_len - s, context_len, device=q.device)[:, None]
        k_pos = torch.arange(start, context_len, device=q.device)[None, :]
        mask = k_pos <= q_pos
        if sliding_window is not None:
            mask &= k_pos > q_pos - sliding_window
        mask = mask[None, None]
    out = _attend(q.transpose(0, 1).unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), mask, scale, sinks)
    return out.squeeze(0).transpose(0, 1)


def verify_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                     context_len: int, scale: float, sliding_window: int | None = None,
                     sinks: torch.Tensor | None = None, kernel: str | None = None) -> torch.Tensor:
    """A chunk that scores drafts, each of its S rows attended exactly as decode_attention attends a single
    sequence's token at that position: the same kernel on the same shapes, so that greedy speculation accepts
    exactly the tokens plain decoding would have produced (a masked multi-row attention rounds differently).
    kernel: as decode_attention's."""
    s, hq, d = q.shape
    if (kernel or rows_kernel(q, k_cache, v_cache)) == C:
        lens = torch.arange(context_len - s + 1, context_len + 1)
        return _native_rows(q, k_cache, v_cache, block_table.expand(s, -1), lens, scale, sliding_window, sinks)
    out = torch.empty_like(q)
    if sliding_window is not None or sinks is not None:  # decoding masks these rows, whatever the length
        for i in range(s):
            n = torch.tensor([context_len - s + i + 1], device=q.device)
            out[i:i + 1] = decode_attention(q[i:i + 1], k_cache, v_cache, block_table[None], n, scale,
                                            sliding_window, sinks=sinks)
        return out
    hkv = k_cache.shape[2]
    blocks = block_table[:(context_len + k_cache.shape[1] - 1) // k_cache.shape[1]]
    k = k_cache.index_select(0, blocks).to(q.dtype).view(1, -1, hkv, d).transpose(1, 2)
    v = v_cache.index_select(0, blocks).to(q.dtype).view(1, -1, hkv, d).transpose(1, 2)
    rows = q.unsqueeze(2)  # [S, Hq, 1, D]: row i as decode's [1, Hq, 1, D]
    for i in range(s):
        n = context_len - s + i + 1
        out[i] = F.scaled_dot_product_attention(rows[i:i + 1], k[:, :, :n], v[:, :, :n], scale=scale,
                                                enable_gqa=hq != hkv)[0, :, 0]
    return out


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                    scale: float, sliding_window: int | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Attention for a mixed batch (decode tokens first, then prompt chunks); kv already stored."""
    kernel = attention_kernel(q, k_cache, v_cache)
    if kernel == TRITON:
        return _paged_attention_cuda(q, k_cache, v_cache, meta, scale, sliding_window, sinks)
    n = meta.num_decode
    if not meta.prefills:  # a decode step: no copy into a shared output
        return decode_attention(q, k_cache, v_cache, meta.decode_block_tables, meta.decode_context_lens, scale,
                                sliding_window, meta.decode_uniform_len, sinks, kernel)
    out = torch.empty_like(q)
    if n:
        out[:n] = decode_attention(q[:n], k_cache, v_cache, meta.decode_block_tables, meta.decode_context_lens,
                                   scale, sliding_window, meta.decode_uniform_len, sinks, kernel)
    for chunk in meta.prefills:
        rows = q[chunk.start:chunk.end]
        if chunk.verifies:
            out[chunk.start:chunk.end] = verify_attention(rows, k_cache, v_cache, chunk.block_table, chunk.context_len,
                                                          scale, sliding_window, sinks, kernel)
        else:
            out[chunk.start:chunk.end] = prefill_attention(rows, k_cache, v_cache, chunk.block_table,
                                                           chunk.context_len, scale, sliding_window, sinks, kernel)
    return out


def _paged_attention_cuda(q, k_cache, v_cache, meta: AttentionMetadata, scale: float, sliding_window, sinks):
    from backend.kernels import triton_kernels

    n = meta.num_decode
    if not meta.prefills:
        return triton_kernels.decode_attention(q, k_cache, v_cache, meta.decode_block_tables,
                                               meta.decode_context_lens, scale, sliding_window, sinks)
    out = torch.empty_like(q)
    if n:
        out[:n] = triton_kernels.decode_attention(q[:n], k_cache, v_cache, meta.decode_block_tables,
                                                  meta.decode_context_lens, scale, sliding_window, sinks)
    out[n:] = triton_kernels.prefill_attention(q[n:], k_cache, v_cache, meta.prefill_block_tables, meta.prefill_cu_q,
                                               meta.prefill_context_lens, meta.prefill_max_len, scale, sliding_window,
                                               sinks)
    return out
