"""Speculation for one engine: how many drafts each decoding sequence should get, the proposals for the
sequences a step actually scheduled, and what verification taught (acceptance, stats, draft caches)."""

import logging
from dataclasses import dataclass, replace

from backend.engine.scheduler import StepPlan
from backend.engine.sequence import Sequence
from backend.speculative.speculative_config import SpeculativeConfig

log = logging.getLogger(__name__)


def best_num_drafts(acceptance: float, max_k: int, cost_per_draft: float) -> int:
    """The k that maximises expected tokens per unit of cost.

    With per-token acceptance a, k drafts yield (1 - a^(k+1)) / (1 - a) tokens on average
    (accepted drafts plus the correction or bonus) for a cost of 1 + k * cost_per_draft.
    """
    best_k, best = 0, 1.0
    for k in range(1, max_k + 1):
        expected = k + 1 if acceptance >= 1 else (1 - acceptance ** (k + 1)) / (1 - acceptance)
        value = expected / (1 + k * cost_per_draft)
        if value > best + 1e-9:
            best_k, best = k, value
    return best_k


@dataclass
class _Track:
    acceptance: float = 0.6  # running per-token acceptance rate, which sets k in "auto" mode
    idle_steps: int = 0  # steps since the last proposal, to probe again after a cold spell


class Speculator:
    def __init__(self, spec: SpeculativeConfig, proposer, draft_cost: float, max_model_len: int):
        self.spec = spec
        self.proposer = proposer
        self.draft_cost = draft_cost  # a draft token's cost relative to a target decode step (for "auto")
        self.max_model_len = max_model_len
        self.tracks: dict[int, _Track] = {}
        self.stats = {"draft_tokens": 0, "accepted_tokens": 0, "verifications": 0}

    def wanted(self, running: list[Sequence]) -> dict[int, int]:
        """seq_id -> draft slots for the decoding sequences worth speculating on this step."""
        # Structured-output requests are not speculated: their grammar would have to be rolled back too.
        ready = [s for s in running if s.num_tokens - s.num_computed_tokens == 1 and s.matcher is None]
        if len(ready) > self.spec.max_batch_size:
            # Verification would cost more than it saves. Seeded sampled requests keep speculating so that
            # their output depends only on their own history, never on what else is running.
            ready = [s for s in ready if s.generator is not None and not s.params.greedy]
        wanted = {}
        for seq in ready:
            room = self.max_model_len - seq.num_tokens - 1
            if seq.params.max_tokens is not None:
                room = min(room, seq.params.max_tokens - seq.num_output_tokens - 1)
            k = min(self._num_drafts(seq), room)
            if k > 0:
                wanted[seq.seq_id] = k
        return wanted

    def _num_drafts(self, seq: Sequence) -> int:
        spec = self.spec
        if spec.num_tokens != "auto":
            return spec.num_tokens
        track = self.tracks.setdefault(seq.seq_id, _Track())
        k = best_num_drafts(track.acceptance, spec.max_num_tokens, spec.verify_cost + self.draft_cost)
        if k == 0:
            track.idle_steps += 1
            if track.idle_steps >= 16:  # probe now and then: the text may have turned repetitive
                track.idle_steps = 0
                return 1
        return k

    def propose(self, plan: StepPlan, sampler) -> StepPlan:
        """The plan with drafts for the items that reserved slots, each item's token count following its drafts."""
        items = [item for item in plan if item.max_drafts]
        if not items:
            return plan
        try:
            proposals = self.proposer.propose(items, sampler)
        except Exception:  # noqa: BLE001 drafts are an optimisation: this step verifies none
            log.exception("proposing drafts failed; this step runs without them")
            proposals = [([], None)] * len(items)
            for item in items:
                self.proposer.release(item.seq)  # the draft's cache of it may be half written
        drafted = {id(item): replace(item, draft_tokens=tokens, draft_probs=probs, num_scheduled_tokens=1 + len(tokens))
                   for item, (tokens, probs) in zip(items, proposals)}
        self.stats["draft_tokens"] += sum(len(tokens) for tokens, _ in proposals)
        return [drafted.get(id(item), item) for item in plan]

    def learn(self, plan: StepPlan, tokens: list[list[int] | None]) -> None:
        """After postprocess: acceptance per sequence, stats, and the draft's cache cut to what stands."""
        for item, new in zip(plan, tokens):
            if not item.num_draft or not new:
                continue
            accepted = len(new) - 1
            track = self.tracks.setdefault(item.seq.seq_id, _Track())
            track.acceptance = 0.7 * track.acceptance + 0.3 * accepted / item.num_draft
            self.stats["accepted_tokens"] += accepted
            self.stats["verifications"] += 1
            self.proposer.rollback(item.seq, item.seq.num_computed_tokens)

    def release(self, seq: Sequence) -> None:
        self.tracks.pop(seq.seq_id, None)
        self.proposer.release(seq)
