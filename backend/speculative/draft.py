"""A draft model with its own paged KV cache that proposes k tokens per sequence per step.

The draft runs on the same scheduler-free path as the target: a catch-up pass (every token the
draft has not seen, the whole prompt the first time) that also yields the first draft, then one
batched decode pass per further draft. After verification its cache is rolled back to the
tokens that were accepted. A draft with another vocabulary reads the target's text in its own
tokens and proposes target tokens through a VocabBridge (vocab_bridge.py); its distributions are
moved onto the target's ids before anything is sampled, so the rest is the same for both.
"""

from dataclasses import dataclass, field

import torch

from backend.context_length import fit_context
from backend.engine.block_manager import BlockManager
from backend.engine.model_runner import ModelRunner
from backend.engine.sampler import needs_only_argmax, sampling_probs
from backend.engine.scheduler import ScheduledSeq
from backend.engine.sequence import Sequence
from backend.loader import load_model, load_tokenizer, locate, read_config
from backend.model_config import ModelConfig, ModelLoadError
from backend.speculative.string_drafts import target_drafts
from backend.speculative.vocab_bridge import VocabBridge, choose_vocab


@dataclass(eq=False)
class DraftState:
    """What the draft's block manager and runner need of a sequence: its own cache bookkeeping."""

    token_ids: list[int]  # in the draft's vocabulary: the target's tokens so far, then this step's drafts
    num_prompt_tokens: int
    num_computed_tokens: int = 0
    num_cached_tokens: int | None = None
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)
    rope_offset: int = 0  # the draft rotates by its scaled rows at every length (engine/rope_switch.py)
    ends: list[int] = field(default_factory=list)  # per target token read: how many draft tokens reach past it

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


def load_draft(model: str, target: ModelConfig, device: torch.device, dtype: torch.dtype, max_model_len: int,
               products: str = "float32", target_tokenizer=None, vocab: str = "auto"):
    """The draft model's weights (loaded before the KV cache is sized, so its memory is counted), in the target's
    dtype (its KV cache is made in it), its quantized layers' products as the target's (arithmetic.products); and
    the VocabBridge to the target's vocabulary (None: the same vocabulary), chosen by `vocab`."""
    source = locate(model)
    config, reader = read_config(source)
    config, _ = fit_context(config, None, max_model_len)  # YaRN where the target's length is past the draft's
    draft_tokenizer = None
    if target_tokenizer is not None:
        try:
            draft_tokenizer = load_tokenizer(source)
        except ModelLoadError:
            draft_tokenizer = None
    try:
        bridge = choose_vocab(vocab, target_tokenizer, target.vocab_size, draft_tokenizer, config.vocab_size, model)
    except ValueError as e:
        raise ModelLoadError(str(e)) from None
    return load_model(source, config, reader, dtype, device, max_model_len, products=products), bridge


class DraftProposer:
    def __init__(self, model, device: torch.device, dtype: torch.dtype, num_blocks: int, block_size: int,
                 kv_dtype: torch.dtype | None = None, bridge: VocabBridge | None = None):
        self.bridge = bridge
        self.block_manager = BlockManager(num_blocks, block_size, enable_prefix_caching=True)
        self.runner = ModelRunner(model, num_blocks, block_size, device, dtype, kv_dtype)
        self.states: dict[int, DraftState] = {}

    @property
    def model(self):
        """The draft's weights, which its runner holds (None while in a level-2 sleep)."""
        return self.runner.model

    def sleep(self, level: int) -> None:
        """Give back the device memory: the cache always, the weights to host memory (1) or dropped (2)."""
        self.runner.sleep(level)
        self.states.clear()

    def wake_up(self, model, num_blocks: int) -> None:
        """model: the reloaded draft after a level-2 sleep, else None. The prefix cache starts empty: the
        blocks it indexed were freed."""
        self.runner.wake_up(model, num_blocks)
        self.block_manager = BlockManager(num_blocks, self.block_manager.block_size, enable_prefix_caching=True)

    def _follow(self, state: DraftState, target_ids: list[int]) -> None:
        """Make the state's tokens the draft's reading of target_ids, keeping the cache of what they share with
        the tokens it had (drafts of an earlier step that the target accepted included)."""
        n = min(len(state.ends), len(target_ids))  # target tokens never change once written
        del state.ends[n:]
        kept = state.ends[-1] if state.ends else 0
        tokens = state.token_ids[:kept]
        for tid in target_ids[n:]:
            tokens.extend(self.bridge.draft_tokens([tid]) if self.bridge is not None else [tid])
            state.ends.append(len(tokens))
        common = kept  # the first `kept` are the old tokens themselves: compare only what follows
        for a, b in zip(tokens[kept:], state.token_ids[kept:]):
            if a != b:
                break
            common += 1
        state.token_ids = tokens
        if state.num_computed_tokens > common:
            state.num_computed_tokens = common
            del state.block_hashes[common // self.block_manager.block_size:]
            self.block_manager.hash_full_blocks(state)

    def _reserve(self, seq: Sequence, k: int) -> DraftState | None:
        """Bring the sequence's draft state up to date and make room for k - 1 fed drafts."""
        state = self.states.get(seq.seq_id)
        try:
            if state is None:
                state = self.states[seq.seq_id] = DraftState([], 0)
                self._follow(state, seq.token_ids[:seq.num_prompt_tokens])
                state.num_prompt_tokens = state.num_tokens
            self._follow(state, seq.token_ids)
        except ValueError:  # the draft cannot spell this text: no drafts for it
            self.release(seq)
            return None
        if not state.token_ids:  # nothing it can read (token ids outside its tokenizer)
            self.release(seq)
            return None
        # The newest target tokens may give the draft nothing to read (a token outside its tokenizer): it computes
        # its last token again (the same keys and values into the same slot) for the logits it proposes from.
        state.num_computed_tokens = min(state.num_computed_tokens, state.num_tokens - 1)
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

    def propose(self, items: list[ScheduledSeq], sampler) -> list[tuple[list[int], torch.Tensor | None]]:
        """Each item's drafts (up to its max_drafts) and the distributions they were drawn from (None: greedy):
        a catch-up pass over what the draft has not seen yields the first, one batched decode pass each the
        others."""
        active = []
        drafts: dict[int, list[int]] = {id(item): [] for item in items}
        for item in items:
            seq = item.seq
            state = self._reserve(seq, item.max_drafts)
            if state is not None:
                active.append((item, state))
        bridge = self.bridge
        # greedy requests with a string-level bridge propose in the draft's own tokens, turned into the target's
        # at the end (string_drafts.py); the others propose target tokens directly (twins, or the same vocabulary)
        own: dict[int, list[int]] = {id(item): [] for item, _ in active
                                     if bridge is not None and bridge.by_string and item.seq.params.greedy}
        if bridge is not None and not bridge.to_draft:  # no twins: only string drafts are possible
            active = [(item, state) for item, state in active if id(item) in own]
        probs: dict[int, list[torch.Tensor]] = {item.seq.seq_id: [] for item, _ in active}
        for step in range(max((item.max_drafts for item, _ in active), default=0)):
            group = [(item, state) for item, state in active if item.max_drafts > step]
            runs = [ScheduledSeq(state, state.num_tokens - state.num_computed_tokens) for _, state in group]
            logits = self.runner.execute(runs).logits  # on the device, one row each, over the draft's vocabulary
            for run in runs:
                run.seq.num_computed_tokens += run.num_scheduled_tokens
            strings = [id(item) in own for item, _ in group]
            own_top = logits.argmax(dim=-1).tolist() if any(strings) else None
            if bridge is not None and not all(strings):  # only twins can be proposed, as target tokens
                logits = bridge.target_logits(logits)
            simple = [needs_only_argmax(item.seq) and not strings[row] for row, (item, _) in enumerate(group)]
            top = logits.argmax(dim=-1).tolist() if any(simple) else None
            for row, (item, state) in enumerate(group):
                if strings[row]:
                    state.token_ids.append(own_top[row])
                    own[id(item)].append(own_top[row])
                    continue
                if simple[row]:
                    token, q = top[row], None
                else:
                    token, q = self._sample(logits[row], item.seq, item.seq.token_ids + drafts[id(item)], sampler)
                state.token_ids.append(bridge.to_draft[token] if bridge is not None else token)
                drafts[id(item)].append(token)
                if q is not None:
                    probs[item.seq.seq_id].append(q)
        out = []
        for item in items:
            q = probs.get(item.seq.seq_id)
            if id(item) in own:
                drafts[id(item)] = target_drafts(bridge.target_tokenizer, bridge.target_bytes, item.seq.token_ids[-1],
                                                 [bridge.draft_bytes[d] for d in own[id(item)]])[:item.max_drafts]
            out.append((drafts[id(item)], torch.stack(q) if q else None))
        return out

    @staticmethod
    def _sample(logits: torch.Tensor, seq: Sequence, history: list[int], sampler) -> tuple[int, torch.Tensor | None]:
        """The draft's token from its distribution (over the target's ids), processed exactly as the target's will
        be (the target's sampler, on the device, over the same history)."""
        row = sampler.processed(logits[None], [seq], [history])
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
        try:
            self._follow(state, seq.token_ids[:num_valid])
        except ValueError:
            self.release(seq)

    def release(self, seq: Sequence) -> None:
        state = self.states.pop(seq.seq_id, None)
        if state is not None:
            self.block_manager.free_sequence(state)
