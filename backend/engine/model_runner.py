"""Owns the model and its KV cache; turns a scheduled batch into tensors and runs one forward pass."""

import torch

from backend.engine.scheduler import ScheduledSeq
from backend.kernels.attention import AttentionMetadata, PrefillChunk
from backend.models.transformer import Attention, CausalLM


class ModelRunner:
    def __init__(self, model: CausalLM, num_blocks: int, block_size: int, device: torch.device, dtype: torch.dtype):
        self.model = model
        self.device = device
        self.block_size = block_size
        self.dtype = dtype
        self.graphs: dict[int, tuple] = {}  # decode batch size -> (CUDA graph, its output)
        self.allocate_kv_cache(num_blocks)

    def _attention_modules(self) -> list[Attention]:
        return [m for m in self.model.modules() if isinstance(m, Attention)]

    def allocate_kv_cache(self, num_blocks: int) -> None:
        cfg = self.model.config
        shape = (num_blocks, self.block_size, cfg.num_kv_heads, cfg.head_dim)
        # Zeroed: decode attention reads (and masks) slots past each sequence's end, which must be finite.
        for module in self._attention_modules():
            module.k_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
            module.v_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)

    def copy_block(self, source: int, target: int) -> None:
        """Copy one cache block's keys and values in every layer (a forked sequence's partial block)."""
        for module in self._attention_modules():
            module.k_cache[target].copy_(module.k_cache[source])
            module.v_cache[target].copy_(module.v_cache[source])

    def free_kv_cache(self) -> None:
        self.graphs = {}  # they read the caches being freed
        for module in self._attention_modules():
            module.k_cache = module.v_cache = torch.empty(0)

    # CUDA graphs for decode steps -------------------------------------------------------------------------

    def capture_graphs(self, max_num_seqs: int, max_model_len: int) -> None:
        """Record one decode step per batch-size bucket, replayed instead of launching every kernel.

        MoE layers are captured too (their routing never waits for the host); with experts offloaded
        the host picks which experts to copy in, so those models stay eager.
        """
        from backend.models.moe import SparseMoE

        if any(isinstance(m, SparseMoE) and m.expert_cache is not None for m in self.model.modules()):
            return
        largest = min(max_num_seqs, 512)
        sizes = sorted({b for b in (1, 2, 4, 8) if b <= largest} | set(range(16, largest + 1, 16)) | {largest})
        self.allocate_static(largest, max_model_len)
        pool = None
        with torch.inference_mode():
            for bs in reversed(sizes):  # the largest first, so smaller ones reuse its memory pool
                args = self.static_args(bs)
                self.model(*args)  # compiles the kernels and settles allocations before recording
                torch.cuda.synchronize(self.device)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    out = self.model(*args)
                pool = graph.pool()
                self.graphs[bs] = (graph, out)
        torch.cuda.synchronize(self.device)

    def allocate_static(self, largest: int, max_model_len: int) -> None:
        """The inputs a captured decode step reads: a batch of `largest` rows, padded rows write nothing."""
        width = (max_model_len + self.block_size - 1) // self.block_size
        dev = self.device
        self.static = {
            "input_ids": torch.zeros(largest, dtype=torch.long, device=dev),
            "positions": torch.zeros(largest, dtype=torch.long, device=dev),
            "slots": torch.full((largest,), -1, dtype=torch.long, device=dev),
            "tables": torch.zeros(largest, width, dtype=torch.long, device=dev),
            "lens": torch.zeros(largest, dtype=torch.long, device=dev),
        }

    def static_args(self, bs: int) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        st = self.static
        meta = AttentionMetadata(slot_mapping=st["slots"][:bs], num_decode=bs, decode_block_tables=st["tables"][:bs],
                                 decode_context_lens=st["lens"][:bs])
        return st["input_ids"][:bs], st["positions"][:bs], meta

    def fill_static(self, batch: list[ScheduledSeq], bs: int) -> None:
        """Write a decode batch into the static inputs, rows n..bs as padding (slot -1: nothing stored;
        length 0: nothing attended). One host-to-device copy per input."""
        n = len(batch)
        st, bsz, pad = self.static, self.block_size, bs - n
        positions = [item.seq.num_computed_tokens for item in batch]
        st["input_ids"][:bs].copy_(torch.tensor([item.seq.token_ids[p] for item, p in zip(batch, positions)] + [0] * pad))
        st["positions"][:bs].copy_(torch.tensor(positions + [0] * pad))
        st["slots"][:bs].copy_(torch.tensor([item.seq.block_table[p // bsz] * bsz + p % bsz
                                             for item, p in zip(batch, positions)] + [-1] * pad))
        st["lens"][:bs].copy_(torch.tensor([p + 1 for p in positions] + [0] * pad))
        # Columns past a row's own blocks keep older numbers: the kernel reads only a row's first
        # ceil(length / block_size) entries.
        limit = st["tables"].shape[1]  # blocks of max_model_len; a table may hold more (reserved for drafts)
        tables = [item.seq.block_table[:limit] for item in batch]
        width = max(len(t) for t in tables)
        st["tables"][:n, :width].copy_(torch.tensor([t + [0] * (width - len(t)) for t in tables]))

    def _replay(self, batch: list[ScheduledSeq]) -> torch.Tensor:
        """Hidden states of a decode batch through the smallest captured graph that holds it."""
        bs = min(b for b in self.graphs if b >= len(batch))
        self.fill_static(batch, bs)
        graph, out = self.graphs[bs]
        graph.replay()
        return out[:len(batch)]

    @staticmethod
    def kv_bytes_per_block(model_config, block_size: int, dtype: torch.dtype) -> int:
        itemsize = torch.empty(0, dtype=dtype).element_size()
        return 2 * model_config.num_layers * block_size * model_config.num_kv_heads * model_config.head_dim * itemsize

    def _slots(self, block_table: list[int], start: int, end: int) -> list[int]:
        bs = self.block_size
        return [block_table[p // bs] * bs + p % bs for p in range(start, end)]

    def prepare(self, batch: list[ScheduledSeq]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]:
        """Inputs for a batch ordered decode-first, and the rows whose logits are needed, in batch order."""
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        decode = [s for s in batch if s.num_tokens == 1]
        prefill = [s for s in batch if s.num_tokens != 1]
        for item in decode:
            seq = item.seq
            pos = seq.num_computed_tokens
            input_ids.append(seq.token_ids[pos])
            positions.append(pos)
            slots.append(seq.block_table[pos // self.block_size] * self.block_size + pos % self.block_size)
        meta = AttentionMetadata(slot_mapping=torch.empty(0), num_decode=len(decode))
        if decode:
            width = max(len(s.seq.block_table) for s in decode)
            tables = [s.seq.block_table + [0] * (width - len(s.seq.block_table)) for s in decode]
            meta.decode_block_tables = torch.tensor(tables, dtype=torch.long, device=self.device)
            meta.decode_context_lens = torch.tensor([p + 1 for p in positions], dtype=torch.long, device=self.device)
        for item in prefill:
            seq, start, end = item.seq, item.seq.num_computed_tokens, item.seq.num_computed_tokens + item.num_tokens
            row = len(input_ids)
            input_ids.extend((seq.token_ids[start:] + seq.draft_tokens[:item.num_draft])[:item.num_tokens])
            positions.extend(range(start, end))
            slots.extend(self._slots(seq.block_table, start, end))
            # Per-chunk tables serve the torch path; CUDA reads the batched ones below (one copy, not one each).
            table = torch.tensor(seq.block_table, dtype=torch.long) if self.device.type == "cpu" else None
            meta.prefills.append(PrefillChunk(row, row + item.num_tokens, end, table))
        # Each sampling sequence gets its last row; one verifying drafts gets all of its rows.
        rows = {id(item): [i] for i, item in enumerate(decode)}
        rows.update({id(item): list(range(chunk.end - 1 - item.num_draft, chunk.end))
                     for item, chunk in zip(prefill, meta.prefills)})
        sample_rows = [r for item in batch if item.samples for r in rows[id(item)]]
        if prefill:
            first = meta.prefills[0].start
            meta.prefill_cu_q = torch.tensor([c.start - first for c in meta.prefills] + [meta.prefills[-1].end - first],
                                             dtype=torch.long, device=self.device)
            meta.prefill_context_lens = torch.tensor([c.context_len for c in meta.prefills], dtype=torch.long,
                                                     device=self.device)
            width = max(len(item.seq.block_table) for item in prefill)
            meta.prefill_block_tables = torch.tensor([item.seq.block_table + [0] * (width - len(item.seq.block_table))
                                                      for item in prefill], dtype=torch.long, device=self.device)
            meta.prefill_max_len = max(c.end - c.start for c in meta.prefills)
        meta.slot_mapping = torch.tensor(slots, dtype=torch.long, device=self.device)
        return (torch.tensor(input_ids, dtype=torch.long, device=self.device),
                torch.tensor(positions, dtype=torch.long, device=self.device), meta, sample_rows)

    @torch.inference_mode()
    def execute(self, batch: list[ScheduledSeq]) -> torch.Tensor:
        """Runs the batch; returns fp32 logits for its sampling rows (see prepare), in batch order, on the
        device: the caller moves to the host only what it needs (token ids, for greedy requests)."""
        if self.graphs and all(item.num_tokens == 1 and item.samples for item in batch) \
                and len(batch) <= max(self.graphs):
            hidden = self._replay(batch)
            return self.model.compute_logits(hidden)
        input_ids, positions, meta, sample_rows = self.prepare(batch)
        hidden = self.model(input_ids, positions, meta)
        if not sample_rows:
            return torch.empty(0, self.model.config.vocab_size)
        index = torch.tensor(sample_rows, dtype=torch.long, device=self.device)
        return self.model.compute_logits(hidden[index])
