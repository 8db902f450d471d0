"""The gated delta rule (kernels/delta_rule.py): its chunked form against transformers' own and its recurrent
form (ours, our C kernel on the state pool in place) within float32 rounding; and a Gated DeltaNet layer's run that
verifies drafts, which keeps only its accepted rows' state."""

import json

import pytest
import torch

from backend.hf_config import from_hf_config
from backend.kernels import delta_rule


def random_rule_inputs(t: int, hk: int = 2, hv: int = 4, dk: int = 16, dv: int = 8, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(t, hk, dk, generator=g),
        torch.randn(t, hk, dk, generator=g),
        torch.randn(t, hv, dv, generator=g),
        -torch.rand(t, hv, generator=g) * 2,
        torch.rand(t, hv, generator=g),
        torch.randn(hv, dk, dv, generator=g),
    )


@pytest.mark.parametrize("t,chunk", [(1, 64), (150, 64), (37, 16)])
def test_delta_rule_forms_match_transformers_and_each_other(t, chunk):
    from transformers.models.qwen3_next.modeling_qwen3_next import (
        torch_chunk_gated_delta_rule,
        torch_recurrent_gated_delta_rule,
    )

    q, k, v, g, beta, state = random_rule_inputs(t)
    out, final = delta_rule.chunked(q, k, v, g, beta, state, chunk=chunk)
    args = (q[None], k[None], v[None], g[None], beta[None])
    theirs, their_final = torch_chunk_gated_delta_rule(
        *args, initial_state=state[None], output_final_state=True, use_qk_l2norm_in_kernel=True
    )
    torch.testing.assert_close(out, theirs[0], atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(final, their_final[0], atol=2e-5, rtol=1e-5)
    _, their_recurrent = torch_recurrent_gated_delta_rule(
        *args, initial_state=state[None], output_final_state=True, use_qk_l2norm_in_kernel=True
    )
    torch.testing.assert_close(final, their_recurrent[0], atol=2e-5, rtol=1e-5)
    # our recurrent form, a token at a time, from the same state
    s, outs = state[None], []
    for i in range(t):
        o, s = delta_rule.recurrent_step(
            q[i : i + 1], k[i : i + 1], v[i : i + 1], g[i : i + 1], beta[i : i + 1], s
        )
        outs.append(o)
    torch.testing.assert_close(torch.cat(outs), out, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(s[0], final, atol=2e-5, rtol=1e-5)


def test_recurrent_step_runs_each_sequence_from_its_own_state():
    rows = [random_rule_inputs(1, seed=i) for i in range(3)]
    batched = [torch.cat([r[j] for r in rows]) for j in range(5)]
    out, states = delta_rule.recurrent_step(*batched, torch.stack([r[5] for r in rows]))
    for i, r in enumerate(rows):
        alone, state = delta_rule.recurrent_step(*r[:5], r[5][None])
        torch.testing.assert_close(out[i : i + 1], alone)
        torch.testing.assert_close(states[i : i + 1], state)


def test_recurrent_update_in_the_pool_matches_the_step_and_touches_only_its_slots():
    """The decode rows' update on the pool in place (our C kernel on the CPU) against the torch step on gathered
    states: rows 0 and 2 resume their slots, row 1 starts fresh over a stale slot; slot 1 is nobody's."""
    rows = [random_rule_inputs(1, hk=2, hv=4, dk=32, dv=16, seed=i) for i in range(3)]
    q, k, v, g, beta = (torch.cat([r[j] for r in rows]) for j in range(5))
    pool = torch.randn(5, 4, 32, 16)
    slots, fresh = torch.tensor([3, 0, 4]), torch.tensor([False, True, False])
    expected_out, expected = delta_rule.recurrent_step(
        q, k, v, g, beta, pool[slots] * ~fresh[:, None, None, None]
    )
    before = pool.clone()
    out = delta_rule.recurrent_in_pool(q, k, v, g, beta, pool, slots, fresh)
    torch.testing.assert_close(out, expected_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(pool[slots], expected, atol=1e-5, rtol=1e-5)
    assert torch.equal(pool[[1, 2]], before[[1, 2]])


def test_a_verifying_run_keeps_only_its_accepted_rows_state(tiny_dir):
    """A Gated DeltaNet layer decoding 4 tokens one by one, against a run verifying the same 4 rows as drafts: the
    same outputs, and after commit the state decoding reached after the kept rows, for every count kept (1: all
    drafts rejected, 4: all accepted); the other slot untouched."""
    from backend.engine.state_pool import allocate_states
    from backend.kernels.attention import AttentionMetadata, PrefillChunk
    from backend.kernels.delta_rule import StateRows
    from backend.models.gated_deltanet import GatedDeltaNet

    cfg = from_hf_config(json.loads((tiny_dir("qwen3_next") / "config.json").read_text()), "qwen3_next")
    torch.manual_seed(0)
    layer = GatedDeltaNet(cfg, cfg.layers[0].attention)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0.0, 0.3)
    allocate_states([layer], 2, torch.device("cpu"))
    x = torch.randn(10, cfg.hidden_size)
    prompt, rows = x[:6], x[6:]

    def prefill(slot: int) -> None:
        layer(
            prompt,
            None,
            AttentionMetadata(
                torch.empty(0),
                prefills=[PrefillChunk(0, 6, 6, None)],
                states=StateRows(torch.tensor([slot]), (False,)),
            ),
        )

    def states(slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        return layer.conv_state[slot].clone(), layer.delta_state[slot].clone()

    prefill(0)
    decoded, reached = [], []
    for i in range(4):
        meta = AttentionMetadata(
            torch.empty(0),
            num_decode=1,
            decode_context_lens=torch.tensor([7 + i]),
            states=StateRows(torch.tensor([0])),
        )
        decoded.append(layer(rows[i : i + 1], None, meta))
        reached.append(states(0))
    with torch.inference_mode():
        for kept in (1, 2, 4):
            prefill(1)
            other = states(0)
            meta = AttentionMetadata(
                torch.empty(0),
                prefills=[PrefillChunk(0, 4, 10, None, verifies=True)],
                states=StateRows(torch.tensor([1]), (True,)),
            )
            torch.testing.assert_close(layer(rows, None, meta), torch.cat(decoded), atol=1e-6, rtol=1e-6)
            layer.commit([kept])
            for ours, theirs in zip(states(1), reached[kept - 1]):
                torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=1e-6)
            assert all(torch.equal(a, b) for a, b in zip(states(0), other))
