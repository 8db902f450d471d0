"""Continuous batching with chunked prefill and preemption by recomputation.

Every step has a budget of max_num_batched_tokens. Running sequences go first, oldest first, each taking one
token (decode, plus the slots of the drafts it will verify) or a chunk of its prompt, a chunk never taking the
tokens of the decoding sequences behind it. The step's prompt work (prompt chunks and embedding inputs
together) is sized by time (step_budget.py): short while anything decodes or waits for its first chunk, so
streams get a token every step-time target, and shared in equal parts by every prompt in progress and every
request waiting to start, so a new request's first chunk runs in the next step whatever long prompts are under
way (they take turns, not first come first served to their end). Waiting sequences then join in turns by client and,
within one, by request (wait_queue.py), while budget, sequence slots and KV blocks last; one client holds at
most max_seqs_per_client of the slots, so a completion of 128 prompts leaves room for other clients.
When a running sequence needs a block and none is free, the newest running sequence is preempted: its blocks
are freed and it goes back to the front of the queue, to be recomputed (mostly from the prefix cache) later.

An embedding input (seq.pooling) is scheduled as a prompt that is never sampled from: the runner
returns the sum of its hidden rows per chunk, and postprocess finishes it after its last chunk.

The scheduler returns one plan per step and owns the sequences' state after it (postprocess):
computed-token counts, the prefix-cache hashes of full blocks, appended tokens, finishing.
"""

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from backend.engine import rope_switch
from backend.engine.block_manager import BlockManager, StateCopies
from backend.engine.deltas import add_logprob, append_token, record_prompt_logprobs
from backend.engine.embedding import add_rows, mean_vector
from backend.engine.sequence import Sequence, Status
from backend.engine.step_budget import StepBudget, chunk_allowance, fair_share, max_seqs_per_client
from backend.engine.wait_queue import WaitQueue, client_of


@dataclass(frozen=True, eq=False)
class ScheduledSeq:
    """One sequence's part of a step, as the scheduler plans it (drafts added by the speculator make a new one)."""
    seq: Sequence
    num_scheduled_tokens: int  # tokens computed for it this step, its drafts included
    max_drafts: int = 0  # draft slots reserved for it; the proposer fills up to this many
    draft_tokens: list[int] = field(default_factory=list)  # proposed for this step and verified by it
    draft_probs: torch.Tensor | None = None  # the proposer's distribution per draft (None: deterministic)
    pool: bool = False  # an embedding input's chunk: its hidden rows are summed, nothing is sampled
    # its rows give prompt logprobs (engine/prompt_logprobs.py): the request asked, and the chunk has prompt tokens
    # after its rows
    prompt_logprobs: bool = False
    states: StateCopies | None = None  # a hybrid model's state copies around its chunk (engine/state_snapshots.py)

    @property
    def samples(self) -> bool:
        """Whether a token is sampled for it this step (the runner gives it logit rows)."""
        return self.num_scheduled_tokens > 0 and not self.pool and self.computes_last_token

    @property
    def num_draft(self) -> int:
        return len(self.draft_tokens)

    @property
    def computes_last_token(self) -> bool:
        """Whether this step computes the sequence's last known token, so that a new one is sampled."""
        return self.seq.num_computed_tokens + self.num_scheduled_tokens - self.num_draft == self.seq.num_tokens


def _wants_prompt_logprobs(seq: Sequence) -> bool:
    return (seq.params.prompt_logprobs is not None and not seq.pooling
            and seq.num_computed_tokens < seq.num_prompt_tokens - 1)


StepPlan = list[ScheduledSeq]  # in the scheduler's order: running sequences first, then admissions


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 step_budget: StepBudget | None = None, max_prompt_tokens_while_decoding: int | None = None,
                 switch: rope_switch.RopeSwitch | None = None):
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        # a fixed ceiling on the prompt tokens of a step that decodes (long_prefill_token_threshold), under the
        # time budget's own
        self.max_prompt_tokens_while_decoding = max_prompt_tokens_while_decoding or max_num_batched_tokens
        self.step_budget = step_budget or StepBudget(0.25, self.max_prompt_tokens_while_decoding)
        self.waiting = WaitQueue()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.on_release: list[Callable[[Sequence], None]] = []  # when a sequence's blocks are freed
        self.rope_switch = switch  # the engine's, where RoPE switches by length
        self.planned_prompt_tokens = 0  # the last plan's prompt work, which observe() times

    def add(self, seq: Sequence) -> None:
        self.waiting.add(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def observe(self, seconds: float) -> None:
        """The last plan's step took this long (its forward, sampling and postprocess)."""
        self.step_budget.observe(self.planned_prompt_tokens, seconds)

    def _release(self, seq: Sequence) -> None:
        self.block_manager.free_sequence(seq)
        for callback in self.on_release:
            callback(seq)

    def _preempt(self, seq: Sequence) -> None:
        self._release(seq)
        seq.status = Status.WAITING
        seq.pooled = None  # its rows are computed again
        self.waiting.add_first(seq)
        self.num_preemptions += 1

    def _slots_held(self) -> tuple[int, dict[str, int]]:
        """Sequence slots held in all and by client (wait_queue.client_of): a sequence with pending forks (a
        request's other n - 1) holds their slots too, so that they can join the batch once its prompt is
        prefilled."""
        by_client: dict[str, int] = {}
        for s in self.running:
            by_client[client_of(s)] = by_client.get(client_of(s), 0) + 1 + len(s.forks)
        return sum(by_client.values()), by_client

    def schedule(self, drafts: dict[int, int] | None = None) -> StepPlan:
        """This step's plan. drafts: seq_id -> how many draft slots a decoding sequence would like; they are
        reserved only when budget and blocks allow (never by evicting anyone)."""
        budget = self.max_num_batched_tokens
        decoding = sum(1 for s in self.running if s.num_tokens - s.num_computed_tokens == 1)
        prompting = len(self.running) - decoding
        slots, by_client = self._slots_held()
        starting = min(len(self.waiting), max(0, self.max_num_seqs - slots))  # requests that could start now
        busy = bool(decoding or (starting and prompting))  # streams wait on this step, or new requests on prompts
        cap = min(budget, self.max_prompt_tokens_while_decoding) if decoding else budget
        prefill = self.step_budget.prompt_tokens(busy, cap)  # prompt tokens left this step
        # each prompt's part of them: equal parts, where a prompt needing less leaves the rest to the others
        newcomers = [s.num_tokens for s in itertools.islice(self.waiting, starting)]
        needs = [s.num_tokens - s.num_computed_tokens for s in self.running if s.num_tokens - s.num_computed_tokens > 1]
        share = fair_share(needs + newcomers, prefill)  # a long prompt takes at most this (chunk_allowance)
        # what the requests that can start would take is kept for them, up to half, whatever the prompts under way
        running_prefill = prefill - min(sum(chunk_allowance(n, share) for n in newcomers), prefill // 2)
        plan: StepPlan = []
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = seq.num_tokens - seq.num_computed_tokens
            if n > 1:  # a prompt chunk leaves a token for each decoding sequence behind it
                n = min(chunk_allowance(n, share), running_prefill,
                        budget - sum(1 for s in self.running[i + 1:] if s.num_tokens - s.num_computed_tokens == 1))
                if n < 1:
                    i += 1
                    continue
            n, states = self.block_manager.plan_states(seq, n)  # a hybrid model's chunk ends at its snapshot
            if rope_switch.passes(self.rope_switch, seq, n):  # admitted again scaled, recomputed once
                self._preempt(self.running.pop(i))
                continue
            k = (drafts or {}).get(seq.seq_id, 0) if n == 1 and not seq.pooling else 0
            if k and (n + k > budget or rope_switch.passes(self.rope_switch, seq, n + k)
                      or not self.block_manager.append_slots(seq, n + k)):
                k = 0
            n = min(n + k, budget)
            while not self.block_manager.append_slots(seq, n):
                victim = self.running.pop()  # the newest; always at or after position i
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            else:
                plan.append(ScheduledSeq(seq, n, max_drafts=k, pool=seq.pooling,
                                         prompt_logprobs=_wants_prompt_logprobs(seq), states=states))
                budget -= n
                if n > 1 and not k:
                    prefill -= n
                    running_prefill -= n
                i += 1
        if not preempted:  # no admissions in a step that had to evict
            plan += self._admit(min(budget, prefill), share, by_client)
        self.planned_prompt_tokens = sum(item.num_scheduled_tokens for item in plan
                                         if item.pool or item.seq.num_tokens - item.seq.num_computed_tokens > 1)
        return plan

    def _admit(self, tokens: int, share: int, by_client: dict[str, int]) -> StepPlan:
        """Waiting sequences that start this step, in turns by client and request, each with its first chunk (at
        most share tokens), within tokens, the free slots and KV blocks; a client already holding
        max_seqs_per_client slots waits for one of its own to finish."""
        plan: StepPlan = []
        slots = sum(by_client.values())
        per_client = max_seqs_per_client(self.max_num_seqs)
        full = {c for c, held in by_client.items() if held >= per_client}
        while tokens > 0:
            seq = self.waiting.next_outside(full)
            if seq is None:
                break
            need, client = 1 + len(seq.forks), client_of(seq)
            held = by_client.get(client, 0)
            if slots + need > self.max_num_seqs:
                break
            if held and held + need > per_client and not self.waiting.resumes(seq):
                full.add(client)
                continue
            # An embedding input, or a prompt whose logprobs were asked for, needs every row's hidden state, so it
            # computes its cached prefix too.
            every_row = seq.pooling or seq.params.prompt_logprobs is not None
            rope_switch.admit(self.rope_switch, seq)  # before the lookup: the prefix hashes depend on it
            hit_ids, hit_hashes = ([], []) if every_row else self.block_manager.find_cached_prefix(seq)
            n = min(chunk_allowance(seq.num_tokens - len(hit_ids) * self.block_manager.block_size, share), tokens)
            if not self.block_manager.allocate(seq, hit_ids, hit_hashes, n):
                break
            n, states = self.block_manager.plan_states(seq, n, hit_hashes)
            self.waiting.take(seq)
            seq.status = Status.RUNNING
            self.running.append(seq)
            slots += need
            by_client[client] = held + need
            plan.append(ScheduledSeq(seq, n, pool=seq.pooling, prompt_logprobs=_wants_prompt_logprobs(seq), states=states))
            tokens -= n
        return plan

    def start_forks(self, plan: StepPlan, copy_block: Callable[[int, int], None]) -> list[tuple[int, ScheduledSeq]]:
        """Siblings of a sequence whose prompt this step finished take its KV (full blocks shared, the
        partial last one copied) and run from now on; returned as (the parent's plan index, the sibling's item):
        they sample their first tokens from the parent's logits. Without a free block or slot a sibling queues
        first in line instead, to find the prompt in the prefix cache."""
        forks = []
        for index, item in enumerate(plan):
            parent = item.seq
            if not parent.forks or not item.computes_last_token:
                continue
            children, parent.forks = [c for c in parent.forks if not c.finished], []
            for child in children:
                copy = False
                if len(self.running) < self.max_num_seqs:
                    copy = self.block_manager.fork(parent, child, parent.num_computed_tokens + item.num_scheduled_tokens)
                if copy is False:
                    self.waiting.add_first(child)
                    continue
                if copy is not None:
                    copy_block(*copy)
                child.status = Status.RUNNING
                self.running.append(child)
                forks.append((index, ScheduledSeq(child, 0)))
        return forks

    def postprocess(self, plan: StepPlan, tokens: list[list[int] | None], eos_token_ids: set[int],
                    max_model_len: int, tokenizer=None, pooled: dict[int, torch.Tensor] | None = None,
                    prompt_logprobs: dict[int, tuple] | None = None, logprobs: list[list | None] | None = None
                    ) -> list[tuple[Sequence, Exception]]:
        """Advance each sequence by this step: its KV counts and block hashes, its prompt logprobs
        (prompt_logprobs[i]), then the tokens sampled for it (tokens[i] for plan[i]: accepted drafts plus one, or
        None) with their logprob entries (logprobs[i]), finishing it where they end it; an embedding input adds
        pooled[i], its rows' sum, and finishes with its last chunk. Returns the sequences whose tokens could not
        be taken, with the error."""
        failed = []
        for i, (item, new) in enumerate(zip(plan, tokens)):
            seq = item.seq
            if seq.finished:
                continue
            if prompt_logprobs and i in prompt_logprobs:
                record_prompt_logprobs(seq, *prompt_logprobs[i], tokenizer)
            if item.pool:  # its blocks never enter the prefix cache: it is freed as soon as it is done
                seq.num_computed_tokens += item.num_scheduled_tokens
                seq.pooled = add_rows(seq.pooled, pooled[i])
                if seq.num_computed_tokens == seq.num_tokens:
                    seq.embedding = mean_vector(seq.pooled, seq.num_tokens)
                    self.finish(seq, "stop")
                continue
            if item.num_draft:  # the last known token and the accepted drafts (all of new but one) have KV now
                seq.num_computed_tokens += len(new) if new else 1
            else:
                seq.num_computed_tokens += item.num_scheduled_tokens
            self.block_manager.hash_full_blocks(seq)
            if item.max_drafts:  # slots of rejected or never proposed drafts go back
                self.block_manager.trim(seq, seq.num_computed_tokens + 1)
            if not new:
                continue
            entries = logprobs[i] if logprobs else None
            try:
                for j, token in enumerate(new):
                    if entries is not None:
                        add_logprob(seq, token, entries[j])
                    end = append_token(seq, token, eos_token_ids, max_model_len, tokenizer)
                    if end is not None:
                        self.finish(seq, *end)
                        break
            except Exception as e:  # noqa: BLE001 confined to this sequence's request by the caller
                failed.append((seq, e))
        return failed

    def finish(self, seq: Sequence, reason: str, stop_reason: int | str | None = None,
               error: str | None = None, error_param: str | None = None) -> None:
        """Remove a finished, aborted or failed (reason "error", with the error's text, and the setting at fault
        when the request's own input made it fail) sequence and release its blocks."""
        seq.finish_reason, seq.stop_reason = reason, stop_reason
        if error is not None:
            seq.error, seq.error_param = error, error_param
        if seq.status == Status.RUNNING:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)
        self._release(seq)
        seq.status = Status.FINISHED
