"""A draft model with its own paged KV cache that proposes k tokens per sequence per step.

The draft runs on the same scheduler-free path as the target: a catch-up pass (every token the
draft has not seen, the whole prompt the first time) that also yields the first draft, then one
batched decode pass per further draft. After verification its cache is rolled back to the
tokens that were accepted.
"""

from dataclasses import dataclass, field

import torch

from backend.context import fit_context
from backend.engine.block_manager import BlockManager
from backend.engine.model_runner import ModelRunner
from backend.engine.sampler import needs_only_argmax, sampling_probs
from backend.engine.scheduler import ScheduledSeq
from backend.engine.sequence import Sequence
from backend.loader import load_model, locate, read_config
from backend.model_config import ModelConfig, ModelLoadError


@dataclass(eq=False)
class DraftState:
    """What the draft's block manager and runner need of a sequence: its own cache bookkeeping."""

    token_ids: list[int]
    num_prompt_tokens: int
    num_computed_tokens: int = 0
    num_cached_tokens: int | None = None
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)
    unverified_from: int | None = None  # set while drafts fed to the cache await verification

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


def load_draft(model: str, target: ModelConfig, device: torch.device, dtype: torch.dtype, max_model_len: int,
               products: str = "float32"):
    """The draft model's weights (loaded before the KV cache is sized, so its memory is counted), in the target's
    dtype (its KV cache is made in it), its quantized layers' products as the target's (arithmetic.products)."""
    source = locate(model)
    config, reader = read_config(source)
    config, _ = fit_context(config, None, max_model_len)  # YaRN where the target's length is past the draft's
    if config.vocab_size != target.vocab_size:
        raise ModelLoadError(f"draft model {model} has a vocabulary of {config.vocab_size} tokens but the target has "
                             f"{target.vocab_size}; a draft must share the target's vocabulary")
    return load_model(source, config, reader, dtype, device, max_model_len, products=products)


class DraftProposer:
    def __init__(self, model, device: torch.device, dtype: torch.dtype, num_blocks: int, block_size: int,
                 kv_dtype: torch.dtype | None = None):
        self.model = model
        self.block_manager = BlockManager(num_blocks, block_size, enable_prefix_caching=True)
        self.runner = ModelRunner(self.model, num_blocks, block_size, device, dtype, kv_dtype)
        self.states: dict[int, DraftState] = {}

    def sleep(self, level: int) -> None:
        """Give back the device memory: the cache always, the weights to host memory (1) or dropped (2)."""
        self.runner.free_kv_cache()
        self.states.clear()
        if level == 2:
            self.runner.model = self.model = None
        elif self.runner.device.type != "cpu":
            self.model.to("cpu")

    def wake_up(self, model, num_blocks: int) -> None:
        """model: the reloaded draft after a level-2 sleep, else None. The prefix cache starts empty: the
        blocks it indexed were freed."""
        if model is not None:
            self.runner.model = self.model = model
        elif self.runner.device.type != "cpu":
            self.model.to(self.runner.device)
        self.block_manager = BlockManager(num_blocks, self.block_manager.block_size, enable_prefix_caching=True)
        self.runner.allocate_kv_cache(num_blocks)

    def _reserve(self, seq: Sequence, k: int) -> DraftState | None:
        """Bring the sequence's draft state up to date and make room for k - 1 fed drafts."""
        state = self.states.get(seq.seq_id)
        if state is None:
            state = self.states[seq.seq_id] = DraftState(list(seq.token_ids), seq.num_prompt_tokens)
        if state.unverified_from is not None:  # last step's drafts were dropped unverified: forget them
            state.num_computed_tokens = min(state.num_computed_tokens, state.unverified_from)
        state.unverified_from = None
        state.token_ids = list(seq.token_ids)
        if not state.block_table:
            hit_ids, hit_hashes = self.block_manager.find_cached_prefix(state)
            new = state.num_tokens - len(hit_ids) * self.block_manager.block_size + k - 1
            ok = self.block_manager.allocate(state, hit_ids, hit_hashes, new)
        else:
            ok = self.block_manager.append_slots(state, state.num_tokens - state.num_computed_tokens + k - 1)
        if not ok:
            self.release(seq)
            return None
        return state

    def propose(self, items: list[ScheduledSeq], sampler) -> None:
        """Fill each item's drafts (up to its max_drafts): a catch-up pass over what the draft has not seen
        yields the first, one batched decode pass each the others."""
        active = []
        for item in items:
            seq = item.seq
            item.draft_tokens, item.draft_probs = [], None
            state = self._reserve(seq, item.max_drafts)
            if state is not None:
                state.unverified_from = seq.num_tokens
                active.append((item, state))
        probs: dict[int, list[torch.Tensor]] = {item.seq.seq_id: [] for item, _ in active}
        for step in range(max((item.max_drafts for item, _ in active), default=0)):
            group = [(item, state) for item, state in active if item.max_drafts > step]
            runs = [ScheduledSeq(state, state.num_tokens - state.num_computed_tokens) for _, state in group]
            logits = self.runner.execute(runs)  # on the device, one row each
            for run in runs:
                run.seq.num_computed_tokens += run.num_tokens
            simple = [needs_only_argmax(item.seq) for item, _ in group]
            top = logits.argmax(dim=-1).tolist() if any(simple) else None
            for row, (item, state) in enumerate(group):
                if simple[row]:
                    token, q = top[row], None
                else:
                    token, q = self._sample(logits[row], item.seq, state, sampler)
                state.token_ids.append(token)
                item.draft_tokens.append(token)
                if q is not None:
                    probs[item.seq.seq_id].append(q)
        for item, _ in active:
            item.draft_probs = torch.stack(probs[item.seq.seq_id]) if probs[item.seq.seq_id] else None

    @staticmethod
    def _sample(logits: torch.Tensor, seq: Sequence, state: DraftState, sampler) -> tuple[int, torch.Tensor | None]:
        """The draft's token from its distribution, processed exactly as the target's will be (the target's
        sampler, on the device)."""
        row = sampler.processed(logits[None], [seq], [state.token_ids])
        if seq.params.greedy:
            return int(row.argmax()), None
        q = sampling_probs(row, [seq.params])[0]
        q = q / q.sum()
        return int(sampler.draw(q[None], [seq])[0]), q

    def rollback(self, seq: Sequence, num_valid: int) -> None:
        """Only the first num_valid tokens of the sequence are the ones the draft saw; forget the rest."""
        state = self.states.get(seq.seq_id)
        if state is None:
            return
        state.num_computed_tokens = min(state.num_computed_tokens, num_valid)
        state.token_ids = state.token_ids[:num_valid]
        state.unverified_from = None
        del state.block_hashes[state.num_computed_tokens // self.block_manager.block_size:]
        self.block_manager.hash_full_blocks(state)

    def release(self, seq: Sequence) -> None:
        state = self.states.pop(seq.seq_id, None)
        if state is not None:
            self.block_manager.free_sequence(state)
