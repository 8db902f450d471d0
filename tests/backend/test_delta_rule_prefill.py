"""The gated delta rule's prompt runs on the state pool (kernels/delta_rule.recurrent_in_pool with run: our C kernel, the
recurrent form token by token) against the chunked form, from a slot's state and from zeros; and the value heads'
tiled order (llama.cpp's qwen35moe files) as the checkpoints' grouped order with the heads permuted, in every form."""

import pytest
import torch

from backend.kernels import delta_rule, native
from tests.backend.test_delta_rule import random_rule_inputs

HK, HV, DK, DV = 2, 6, 16, 8


def _inputs(t: int, seed: int = 0):
    return random_rule_inputs(t, HK, HV, DK, DV, seed)


def _run_in_pool(q, k, v, g, beta, pool, slot: int, fresh: bool, tiled: bool = False) -> torch.Tensor:
    slots, starts = torch.tensor([slot]), torch.tensor([fresh])
    return delta_rule.recurrent_in_pool(q, k, v, g, beta, pool, slots, starts, tiled, run=True)


@pytest.mark.parametrize("tiled", [False, True])
@pytest.mark.parametrize("t", [1, 37, 150])
def test_c_prompt_run_matches_the_chunked_form(t, tiled):
    assert native.enabled()
    q, k, v, g, beta, state = _inputs(t)
    pool = torch.zeros(3, HV, DK, DV)
    pool[1], pool[2] = state, 5.0
    expected, final = delta_rule.chunked(q, k, v, g, beta, state, chunk=16, tiled=tiled)
    out = _run_in_pool(q, k, v, g, beta, pool, 1, False, tiled)
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(pool[1], final, atol=2e-5, rtol=1e-5)
    # fresh: from zeros, whatever the slot held; the other slots untouched
    expected, final = delta_rule.chunked(q, k, v, g, beta, None, tiled=tiled)
    out = _run_in_pool(q, k, v, g, beta, pool, 2, True, tiled)
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(pool[2], final, atol=2e-5, rtol=1e-5)
    assert pool[0].abs().max() == 0


def test_tiled_value_heads_are_the_grouped_ones_permuted():
    """Value head j * HK + h of the tiled order is head h * (HV / HK) + j of the grouped one: both read key head h."""
    per = HV // HK
    tiled_of = torch.tensor(
        [h * per + j for j in range(per) for h in range(HK)]
    )  # tiled position -> grouped head
    q, k, v, g, beta, state = _inputs(40, seed=1)
    grouped_out, grouped_final = delta_rule.chunked(q, k, v, g, beta, state)
    tiled_out, tiled_final = delta_rule.chunked(
        q, k, v[:, tiled_of], g[:, tiled_of], beta[:, tiled_of], state[tiled_of], tiled=True
    )
    torch.testing.assert_close(tiled_out, grouped_out[:, tiled_of], atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(tiled_final, grouped_final[tiled_of], atol=2e-5, rtol=1e-5)
    pool = state[tiled_of][None].clone().contiguous()
    step, _ = delta_rule.recurrent_step(q[:1], k[:1], v[:1], g[:1], beta[:1], state[None].clone())
    fresh = torch.zeros(1, dtype=torch.bool)
    ours = delta_rule.recurrent_in_pool(
        q[:1],
        k[:1],
        v[:1, tiled_of],
        g[:1, tiled_of],
        beta[:1, tiled_of],
        pool,
        torch.tensor([0]),
        fresh,
        True,
    )
    torch.testing.assert_close(ours, step[:, tiled_of], atol=2e-5, rtol=1e-5)
    # read in the grouped order, the same tensors meet other key heads
    misread, _ = delta_rule.chunked(q, k, v[:, tiled_of], g[:, tiled_of], beta[:, tiled_of], state[tiled_of])
    assert (misread - tiled_out).abs().max() > 1e-2


@pytest.mark.parametrize("dv", [8, 40, 64])  # a state's columns: within one block of the kernel's, across two
def test_a_prompt_state_is_the_same_whatever_runs_it_is_cut_into(dv, c_kernels):
    """Our C kernel's run takes the state a block of columns at a time (16-lane vectors with AVX-512, 8-lane ones
    in the other builds): a sequence's 200 tokens as one run, as runs of 65 and 135 tokens (steps' prompt chunks
    past one chunk of the chunked form), and as decode rows one at a time give the same outputs and state to the
    bit, and those of the chunked form within float32 rounding."""
    assert native.enabled()
    q, k, v, g, beta, state = random_rule_inputs(200, HK, HV, DK, dv, seed=2)
    pool = torch.zeros(3, HV, DK, dv)
    pool[0] = pool[1] = pool[2] = state
    whole = _run_in_pool(q, k, v, g, beta, pool, 0, False)
    cuts, bounds = [], [0, 65, 200]
    for start, end in zip(bounds, bounds[1:]):
        rows = slice(start, end)
        cuts.append(_run_in_pool(q[rows], k[rows], v[rows], g[rows], beta[rows], pool, 1, False))
    decoded = [
        delta_rule.recurrent_in_pool(
            q[i : i + 1],
            k[i : i + 1],
            v[i : i + 1],
            g[i : i + 1],
            beta[i : i + 1],
            pool,
            torch.tensor([2]),
            torch.tensor([False]),
        )
        for i in range(200)
    ]
    assert torch.equal(torch.cat(cuts), whole) and torch.equal(torch.cat(decoded), whole)
    assert torch.equal(pool[1], pool[0]) and torch.equal(pool[2], pool[0])
    expected, final = delta_rule.chunked(q, k, v, g, beta, state)
    torch.testing.assert_close(whole, expected, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(pool[0], final, atol=2e-5, rtol=1e-5)
