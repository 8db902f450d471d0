"""Owns the model and its KV cache; turns a scheduled batch into tensors and runs one forward pass."""

from dataclasses import dataclass, field

import torch

from backend.engine import cache_groups
from backend.engine.prompt_logprobs import chunk_prompt_logprobs
from backend.engine.scheduler import ScheduledSeq, StepPlan
from backend.engine.state_pool import allocate_states, free_states, resume_states, snapshot_states
from backend.engine.step_inputs import StepInputs, lay_out
from backend.kernels import step_paths
from backend.kernels.attention import AttentionMetadata, PrefillChunk
from backend.kernels.delta_rule import StateRows
from backend.models.cpu_decoder import CpuDecoder
from backend.models.gated_deltanet import GatedDeltaNet
from backend.models.transformer import CausalLM


@dataclass
class StepOutput:
    """What a forward pass hands the sample and postprocess stages."""
    logits: torch.Tensor  # fp32, of the sampling rows only, on the device
    logit_rows: list[slice | None]  # per plan item: its rows of logits (None: it samples nothing)
    pooled: dict[int, torch.Tensor] = field(default_factory=dict)  # plan index -> an embedding chunk's row sum
    prompt_logprobs: dict[int, tuple] = field(default_factory=dict)  # plan index -> (first token, entries)


class ModelRunner:
    def __init__(self, model: CausalLM, num_blocks: int, block_size: int, device: torch.device, dtype: torch.dtype,
                 kv_dtype: torch.dtype | None = None, state_slots: int = 0,
                 sliding: cache_groups.SlidingGroup | None = None):
        self.model = model
        self.sliding = sliding  # the sliding layers' own pool (engine/cache_groups.py); None: theirs is the full one
        self.state_slots = state_slots  # a hybrid model's linear-attention states (engine/state_pool.py)
        self.device = device
        self.block_size = block_size
        self.dtype = dtype
        self.kv_dtype = kv_dtype or dtype  # the KV cache's (kv_cache_dtype; the model's by default)
        self.graphs: dict[int, tuple] = {}  # decode batch size -> (CUDA graph, its output)
        self.steps = dict.fromkeys(step_paths.STEP_PATHS, 0)  # forward passes by the path that ran them
        self.kernels = step_paths.kernels_for(device, dtype)  # which of our C and Triton kernels its steps may use
        self.cpu_decoder: CpuDecoder | None = None  # decode steps in one C call, where the model allows
        self.allocate_kv_cache(num_blocks)

    def _attention_modules(self) -> list[torch.nn.Module]:
        """Each layer's attention module, whatever its kind: the holders of k_cache and v_cache."""
        return [layer.self_attn for layer in self.model.model.layers]

    def allocate_kv_cache(self, num_blocks: int) -> None:
        cfg = self.model.config
        # Zeroed: decode attention reads (and masks) slots past each sequence's end, which must be finite.
        zeros = cache_groups.host_zeros if self.device.type == "cpu" else torch.zeros
        for module, spec in zip(self._attention_modules(), cfg.layers, strict=True):
            k_block, v_block = spec.attention.block_shapes(self.block_size, cfg.num_kv_heads, cfg.head_dim)
            rows = self.sliding.num_blocks if self._windowed(spec.attention.kind) else num_blocks
            module.k_cache = zeros((rows, *k_block), dtype=self.kv_dtype, device=self.device)
            module.v_cache = zeros((rows, *v_block), dtype=self.kv_dtype, device=self.device)
        allocate_states(self._attention_modules(), self.state_slots, self.device)
        self.cpu_decoder = CpuDecoder.build(self.model) if self.kernels.c else None

    def _windowed(self, kind: str) -> bool:
        return self.sliding is not None and kind == "sliding"

    def copy_block(self, source: int, target: int, window_source: int = 0, window_target: int = 0) -> None:
        """Copy one cache block's keys and values in every layer (a forked sequence's partial block; the sliding
        group's own copy of it in its layers)."""
        for module, spec in zip(self._attention_modules(), self.model.config.layers, strict=True):
            src, dst = (window_source, window_target) if self._windowed(spec.attention.kind) else (source, target)
            module.k_cache[dst].copy_(module.k_cache[src])
            module.v_cache[dst].copy_(module.v_cache[src])

    def free_kv_cache(self) -> None:
        self.graphs = {}  # they read the caches being freed
        self.cpu_decoder = None
        for module in self._attention_modules():
            module.k_cache = module.v_cache = torch.empty(0)
        free_states(self._attention_modules())

    def sleep(self, level: int) -> None:
        """Give the device's memory back: the cache always, the weights to host memory (1) or dropped (2)."""
        self.free_kv_cache()
        if level == 2:
            self.model = None
        elif self.device.type != "cpu":
            self.model.to("cpu")

    def wake_up(self, model: CausalLM | None, num_blocks: int) -> None:
        """model: the weights read again after a level-2 sleep, else None (they come back from host memory)."""
        if model is not None:
            self.model = model
        elif self.device.type != "cpu":
            self.model.to(self.device)
        self.allocate_kv_cache(num_blocks)

    # CUDA graphs for decode steps -------------------------------------------------------------------------

    def capture_graphs(self, max_rows: int, max_model_len: int, largest_only: bool = False) -> None:
        """Record one decode step per bucket of rows, replayed instead of launching every kernel (largest_only: the
        bucket of max_rows alone, whose memory pool the others share: what the KV cache's sizing measures).
        Which models stay eager: step_paths.captures_graphs."""
        from backend.models.moe import SparseMoE

        offloaded = any(isinstance(m, SparseMoE) and m.expert_cache is not None for m in self.model.modules())
        if not step_paths.captures_graphs(bool(self.state_slots), offloaded):
            return
        largest = max_rows
        sizes = [largest] if largest_only else step_paths.graph_buckets(largest)
        self.allocate_static(largest, max_model_len)
        pool = None
        with torch.inference_mode():
            for batch_size in reversed(sizes):  # the largest first, so smaller ones reuse its memory pool
                args = self.static_args(batch_size)
                self.model(*args)  # compiles the kernels and settles allocations before recording
                torch.cuda.synchronize(self.device)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    out = self.model(*args)
                pool = graph.pool()
                self.graphs[batch_size] = (graph, out)
        torch.cuda.synchronize(self.device)

    def allocate_static(self, largest: int, max_model_len: int) -> None:
        """The inputs a captured decode step reads: a batch of `largest` rows, padded rows write nothing."""
        width = (max_model_len + self.block_size - 1) // self.block_size
        dev = self.device
        self.static_positions = width * self.block_size  # rows at or past it have no table to replay with
        self.static = {
            "input_ids": torch.zeros(largest, dtype=torch.long, device=dev),
            "positions": torch.zeros(largest, dtype=torch.long, device=dev),
            "slots": torch.full((largest,), -1, dtype=torch.long, device=dev),
            "tables": torch.zeros(largest, width, dtype=torch.long, device=dev),
            "lens": torch.zeros(largest, dtype=torch.long, device=dev),
        } | (cache_groups.window_static(largest, width, dev) if self.sliding else {})

    def static_args(self, batch_size: int) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        st, b = self.static, batch_size
        meta = AttentionMetadata(slot_mapping=st["slots"][:b], num_decode=b, decode_block_tables=st["tables"][:b],
                                 decode_context_lens=st["lens"][:b])
        meta.sliding = cache_groups.window_static_meta(meta, st, b) if self.sliding else None
        return st["input_ids"][:b], st["positions"][:b], meta

    def fill_static(self, inputs: StepInputs, batch_size: int) -> None:
        """Write a decode batch's rows into the static inputs, rows past it as padding (slot -1: nothing stored;
        length 0: nothing attended). One host-to-device copy per input."""
        n, b = len(inputs.input_ids), batch_size
        st, pad = self.static, batch_size - n
        st["input_ids"][:b].copy_(torch.tensor(inputs.input_ids + [0] * pad))
        st["positions"][:b].copy_(torch.tensor(inputs.rope_rows + [0] * pad))
        st["slots"][:b].copy_(torch.tensor(inputs.slots + [-1] * pad))
        st["lens"][:b].copy_(torch.tensor([p + 1 for p in inputs.positions] + [0] * pad))
        # Columns past a row's own blocks keep older numbers: the kernel reads only a row's first
        # ceil(length / block_size) entries.
        limit = st["tables"].shape[1]  # blocks of max_model_len; a table may hold more (reserved for drafts)
        tables = [table[:limit] for table in inputs.tables]
        width = max(len(t) for t in tables)
        st["tables"][:n, :width].copy_(torch.tensor([t + [0] * (width - len(t)) for t in tables]))
        if self.sliding:
            cache_groups.fill_window_static(st, inputs.window_slots, inputs.window_tables, b)

    def _replay(self, inputs: StepInputs) -> torch.Tensor:
        """Hidden states of a step's rows (all decode rows) through the smallest captured graph that holds them."""
        rows = len(inputs.input_ids)
        batch_size = min(b for b in self.graphs if b >= rows)
        self.fill_static(inputs, batch_size)
        graph, out = self.graphs[batch_size]
        graph.replay()
        return out[:rows]

    def path_parts(self) -> step_paths.RunnerParts:
        """What the step-path table (kernels/step_paths.py) reads of this runner as it is now."""
        decoder = self.cpu_decoder
        return step_paths.RunnerParts(
            self.kernels, hybrid=bool(self.state_slots), one_call=decoder is not None,
            one_call_rows=decoder.max_rows if decoder is not None else None, graph_rows=max(self.graphs, default=0),
            graph_positions=self.static_positions if self.graphs else 0)

    def lay_out(self, plan: StepPlan) -> StepInputs:
        parts = self.path_parts()

        def attends_as_decode(item: ScheduledSeq) -> bool:
            return step_paths.attends_as_decode(parts, item.num_scheduled_tokens, item.num_draft,
                                                item.seq.num_computed_tokens)

        return lay_out(plan, self.block_size, attends_as_decode, self.sliding is not None)

    def prepare(self, plan: StepPlan) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, StepInputs]:
        """The plan's rows (step_inputs.lay_out) as the model's tensors and attention metadata."""
        inputs = self.lay_out(plan)
        n = inputs.num_decode
        meta = AttentionMetadata(slot_mapping=self._tensor(inputs.slots), num_decode=n)
        if inputs.decode:
            meta.decode_block_tables = self._tables(inputs.tables)
            meta.decode_context_lens = self._tensor([p + 1 for p in inputs.positions[:n]])
            if len(set(inputs.positions[:n])) == 1:
                meta.decode_uniform_len = inputs.positions[0] + 1
        for i in inputs.prefill:
            item, rows = plan[i], inputs.hidden_rows[i]
            # Per-chunk tables serve the torch path; CUDA reads the batched ones below (one copy, not one each).
            table = torch.tensor(item.seq.block_table, dtype=torch.long) if self.device.type == "cpu" else None
            meta.prefills.append(PrefillChunk(rows.start, rows.stop, item.seq.num_computed_tokens + item.num_scheduled_tokens,
                                              table, verifies=item.num_draft > 0 and item.seq.params.greedy))
        if self.state_slots:  # each decode row's sequence's state slot, then each prompt chunk's
            slots = [plan[i].seq.state_slot for i in inputs.decode] + [plan[i].seq.state_slot for i in inputs.prefill]
            meta.states = StateRows(self._tensor(slots), tuple(plan[i].num_draft > 0 for i in inputs.prefill))
        if inputs.prefill:
            meta.prefill_cu_q = self._tensor([c.start - n for c in meta.prefills] + [meta.prefills[-1].end - n])
            meta.prefill_context_lens = self._tensor([c.context_len for c in meta.prefills])
            meta.prefill_block_tables = self._tables([plan[i].seq.block_table for i in inputs.prefill])
            meta.prefill_max_len = max(c.end - c.start for c in meta.prefills)
        if self.sliding:  # what the sliding layers read: the same rows in their own pool
            meta.sliding = cache_groups.window_metadata(meta, inputs.window_tables, inputs.window_slots,
                                                        [plan[i].seq.window_table for i in inputs.prefill], self.device)
        return self._tensor(inputs.input_ids), self._tensor(inputs.rope_rows), meta, inputs

    def _tensor(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)

    def _tables(self, tables: list[list[int]]) -> torch.Tensor:
        """Block tables as one tensor, each padded with 0 to the longest."""
        width = max(len(t) for t in tables)
        return self._tensor([t + [0] * (width - len(t)) for t in tables])

    @torch.inference_mode()
    def commit_states(self, plan: StepPlan, tokens: list[list[int] | None]) -> None:
        """A hybrid model's runs that verified drafts keep the state after the rows postprocess keeps: the last
        known token and the accepted drafts (len(tokens[i]), as postprocess counts them)."""
        snapshot_states(self._attention_modules(), plan)  # prefix-hit snapshots at block boundaries (state_snapshots.py)
        kept = [len(new) if new else 1 for item, new in zip(plan, tokens) if item.num_draft]
        if self.state_slots and kept:
            for module in self._attention_modules():
                if isinstance(module, GatedDeltaNet):
                    module.commit(kept)

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> StepOutput:
        """Runs the plan: fp32 logits of its sampling rows on the device (the caller moves to the host only what it
        needs: token ids, for greedy requests), whose rows are whose, and by position in the plan each embedding
        input chunk's (item.pool) fp32 sum of its hidden rows, and for each chunk of a request that asked for
        prompt logprobs, (the index of the first prompt token they are for, their entries)."""
        # A step reading rows besides the sampled ones runs through the modules, as embeddings always have (the
        # one-call step and graphs have kernels of their own): step_paths decides
        path = step_paths.step_path(self.path_parts(), [path_item(item) for item in plan])
        self.steps[path] += 1
        if path == step_paths.GRAPH:
            inputs = lay_out(plan, self.block_size, lambda item: True, self.sliding is not None)
            hidden = self._replay(inputs)
            if len(inputs.sample_rows) < hidden.shape[0]:  # a run that samples only its last row, or nothing
                hidden = hidden[torch.tensor(inputs.sample_rows, dtype=torch.long, device=self.device)]
            return StepOutput(self.model.compute_logits(hidden), inputs.logit_rows)
        resume_states(self._attention_modules(), plan)  # a hybrid model's prefix hits start from their snapshots
        input_ids, positions, meta, inputs = self.prepare(plan)
        if path == step_paths.ONE_CALL:
            hidden = self.cpu_decoder(input_ids, positions, meta)
        else:
            hidden = self.model(input_ids, positions, meta)
        pooled = {i: hidden[inputs.hidden_rows[i]].float().sum(dim=0) for i, item in enumerate(plan) if item.pool}
        prompt_logprobs = {i: chunk_prompt_logprobs(self.model.compute_logits, hidden[inputs.hidden_rows[i]], item)
                           for i, item in enumerate(plan) if item.prompt_logprobs}
        if not inputs.sample_rows:
            return StepOutput(torch.empty(0, self.model.config.vocab_size), inputs.logit_rows, pooled,
                              prompt_logprobs)
        index = torch.tensor(inputs.sample_rows, dtype=torch.long, device=self.device)
        return StepOutput(self.model.compute_logits(hidden[index]), inputs.logit_rows, pooled, prompt_logprobs)


def path_item(item: ScheduledSeq) -> step_paths.Item:
    """What the step-path table reads of a scheduled item."""
    return step_paths.Item(item.num_scheduled_tokens, item.num_draft, item.seq.num_computed_tokens,
                           item.pool or item.prompt_logprobs)
