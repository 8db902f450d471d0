"""Embeddings: each input's last hidden state (after the final norm), mean-pooled over its tokens and
L2-normalised.

The inputs run through the model as prompt chunks, exactly as prefill does, but outside the scheduler:
they get free KV blocks of their own for the pass (released after it, never in the prefix cache), so the
blocks of running generations are not touched. Called on the engine's thread between steps.
"""

import torch

from backend.engine.scheduler import ScheduledSeq
from backend.engine.sequence import Sequence
from backend.sampling_params import SamplingParams

POOLING = {"pooling": "mean", "normalized": True, "source": "last hidden state"}


class NoRoom(RuntimeError):
    """The KV cache has too few free blocks for these inputs right now (running generations hold them)."""


def _groups(inputs: list[list[int]], free_blocks: int, block_size: int) -> list[list[int]]:
    """Input indices in groups whose blocks fit in what is free."""
    groups, current, used = [], [], 0
    for i, ids in enumerate(inputs):
        need = -(-len(ids) // block_size)
        if need > free_blocks:
            raise NoRoom(f"an input of {len(ids)} tokens needs {need} KV-cache blocks; {free_blocks} are free")
        if used + need > free_blocks:
            groups.append(current)
            current, used = [], 0
        current.append(i)
        used += need
    if current:
        groups.append(current)
    return groups


@torch.inference_mode()
def embed(engine, inputs: list[list[int]]) -> list[torch.Tensor]:
    """One normalised float32 vector (on the CPU) per input of token ids."""
    bm, runner = engine.block_manager, engine.runner
    out: list[torch.Tensor | None] = [None] * len(inputs)
    params = SamplingParams(max_tokens=1)
    for group in _groups(inputs, bm.num_free_blocks, bm.block_size):
        seqs = {}
        for i in group:
            blocks = bm.take_blocks(bm.blocks_for(len(inputs[i])))
            if blocks is None:  # cannot happen between steps; refuse rather than touch others' blocks
                for seq in seqs.values():
                    bm.release_blocks(seq.block_table)
                raise NoRoom("the KV cache filled up")
            seqs[i] = Sequence(seq_id=-1 - i, request_id="embedding", index=0, token_ids=list(inputs[i]),
                               num_prompt_tokens=len(inputs[i]), params=params, block_table=blocks)
        sums = {i: None for i in group}
        try:
            while any(s.num_computed_tokens < s.num_tokens for s in seqs.values()):
                budget, plan = engine.max_num_batched_tokens, []
                for seq in seqs.values():
                    take = min(seq.num_tokens - seq.num_computed_tokens, budget)
                    if take > 0:
                        plan.append(ScheduledSeq(seq, take))
                        budget -= take
                input_ids, positions, meta, _ = runner.prepare(plan)
                hidden = runner.model(input_ids, positions, meta).float()
                for item in plan:
                    i = -1 - item.seq.seq_id
                    part = hidden[item.hidden_rows].sum(dim=0)
                    sums[i] = part if sums[i] is None else sums[i] + part
                    item.seq.num_computed_tokens += item.num_tokens
        finally:
            for seq in seqs.values():
                bm.release_blocks(seq.block_table)
        for i in group:
            mean = sums[i] / len(inputs[i])
            out[i] = torch.nn.functional.normalize(mean, dim=0).cpu()
    return out
