"""MoE experts that do not fit the device: copied in as batches route to them (ExpertCache), or computed where they
live, on the CPU (SplitExperts, moe_cpu_compute); every batch's output is the all-resident model's."""

import pytest
import torch

from backend.kernels.moe_torch import fused_moe, route


def test_an_expert_cache_keeps_only_offloaded_experts_in_host_memory():
    """3 slots for 6 experts, top-2: experts 0 stays on the device for good (no host copy, never copied again),
    two slots rotate among experts 1-5. Every batch's output is the all-resident one."""
    from backend.models.expert_cache import ExpertCache

    g = torch.Generator().manual_seed(3)
    w_gate_up, w_down = torch.randn(6, 2 * 24, 16, generator=g), torch.randn(6, 16, 24, generator=g)
    cache = ExpertCache([w_gate_up, w_down], 3, 2, torch.device("cpu"),
                        lambda x, stacks, w, ids: fused_moe(x, stacks[0], stacks[1], w, ids))
    assert cache.resident == 1 and [h.shape[0] for h in cache.host] == [5, 5]
    assert cache.host_bytes() == 5 * (2 * 24 * 16 + 16 * 24) * 4
    for tokens in (1, 1, 3, 8, 1):
        x = torch.randn(tokens, 16, generator=g)
        weights, ids = route(torch.randn(tokens, 6, generator=g), 2, renormalize=True)
        torch.testing.assert_close(cache.compute(x, weights, ids), fused_moe(x, w_gate_up, w_down, weights, ids),
                                   atol=1e-5, rtol=1e-5)
    assert 0 not in cache.slot_of and set(cache.slot_of.values()) <= {1, 2} and cache.misses > 0


def test_experts_copied_ahead_on_a_guess_are_hits_and_a_wrong_guess_costs_only_copies():
    """prefetch(): the guessed offloaded experts are copied in before the batch that uses them (no copy then,
    counted as hits of the guess); a wrong guess leaves the batch to copy its own. Outputs stay the resident ones."""
    from backend.models.expert_cache import ExpertCache

    g = torch.Generator().manual_seed(5)
    w_gate_up, w_down = torch.randn(6, 2 * 24, 16, generator=g), torch.randn(6, 16, 24, generator=g)
    cache = ExpertCache([w_gate_up, w_down], 3, 2, torch.device("cpu"),
                        lambda x, stacks, w, ids: fused_moe(x, stacks[0], stacks[1], w, ids))
    x = torch.randn(2, 16, generator=g)
    weights = torch.full((2, 2), 0.5)

    def step(routed: list[list[int]]) -> None:
        ids = torch.tensor(routed)
        torch.testing.assert_close(cache.compute(x, weights, ids), fused_moe(x, w_gate_up, w_down, weights, ids),
                                   atol=1e-5, rtol=1e-5)

    cache.prefetch([0, 4, 5, 2])  # likeliest first: 0 is resident, only two slots rotate (4 and 5 are copied)
    assert cache.prefetched == 2 and set(cache.slot_of) == {4, 5} and cache.misses == 0
    step([[4, 0], [5, 4]])
    assert cache.misses == 0 and cache.prefetch_hits == 2 and not cache.ahead
    cache.prefetch([1, 2])  # wrong: the batch routes to 3 and 1
    assert cache.prefetched == 4 and set(cache.slot_of) == {1, 2}
    step([[3, 1], [1, 3]])
    assert cache.misses == 1 and cache.prefetch_hits == 3 and set(cache.slot_of) == {1, 3} and not cache.ahead
    cache.prefetch([1])  # already there: nothing to copy
    assert cache.prefetched == 4


def test_a_layer_guesses_the_next_layers_routing_with_its_router_and_norm(tiny_dir):
    """The guess weight of layer l is layer l+1's router seen through l+1's norm: applied to layer l's normed
    input, it gives l+1's router logits on the same residual normed by l+1's norm."""
    from backend import LLM
    from backend.kernels.norm import rms_norm

    llm = LLM(str(tiny_dir("mixtral")), block_size=8, moe_gpu_experts=2)
    layers = llm.engine.model.model.layers
    assert all(layer.mlp.expert_cache.next[2] is after.mlp.expert_cache for layer, after in zip(layers, layers[1:]))
    assert layers[-1].mlp.expert_cache.next is None
    g = torch.Generator().manual_seed(6)
    for this, after in zip(layers, layers[1:]):
        with torch.no_grad():  # norms of this tiny model are 1: make them differ, as trained ones do
            for norm in (this.post_attention_layernorm, after.post_attention_layernorm):
                norm.weight.copy_(torch.rand(norm.weight.shape, generator=g) + 0.5)
        from backend.loader import _link_ahead

        _link_ahead(llm.engine.model)
        weight, top_k, _ = this.mlp.expert_cache.next
        residual = torch.randn(3, weight.shape[1], generator=g)
        eps = this.post_attention_layernorm.eps
        guessed = rms_norm(residual, this.post_attention_layernorm.weight, eps) @ weight.T
        torch.testing.assert_close(guessed, after.mlp.gate(rms_norm(residual, after.post_attention_layernorm.weight,
                                                                     eps)), atol=1e-5, rtol=1e-5)
        assert top_k == after.mlp.top_k


def test_split_experts_compute_the_host_ones_on_the_cpu_and_never_copy_them():
    """moe_cpu_compute: 3 of 6 experts on the device, 3 in host memory computed there for the pairs routed to them
    (and only those): every batch's output is the all-resident one up to fp32 rounding, nothing is copied in."""
    from backend.models.split_experts import SplitExperts

    g = torch.Generator().manual_seed(4)
    w_gate_up, w_down = torch.randn(6, 2 * 24, 16, generator=g), torch.randn(6, 16, 24, generator=g)
    seen = []

    def host(x, w, ids):
        seen.append(ids.flatten().tolist())
        return fused_moe(x, w_gate_up[3:], w_down[3:], w, ids)

    split = SplitExperts([w_gate_up, w_down], 3, torch.device("cpu"),
                         lambda x, stacks, w, ids: fused_moe(x, stacks[0], stacks[1], w, ids), host, 1234)
    assert [d.shape[0] for d in split.dev] == [3, 3] and split.host_bytes() == 1234
    pairs = 0
    for tokens in (1, 1, 3, 8, 1):
        x = torch.randn(tokens, 16, generator=g)
        weights, ids = route(torch.randn(tokens, 6, generator=g), 2, renormalize=True)
        torch.testing.assert_close(split.compute(x, weights, ids), fused_moe(x, w_gate_up, w_down, weights, ids),
                                   atol=1e-5, rtol=1e-5)
        pairs += int((ids >= 3).sum())
    assert split.host_pairs == pairs == sum(map(len, seen)) > 0
    assert all(0 <= e < 3 for batch in seen for e in batch)  # the host's own ids, 0 .. 2


def test_expert_offload_with_a_budget_smaller_than_the_model_gives_identical_output(tiny_dir):
    from backend import LLM, SamplingParams
    from backend.models.moe import SparseMoE
    from tests.backend.conftest import prompts_of_lengths

    prompts = prompts_of_lengths(5, 23, 40)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    for family in ("mixtral", "qwen2_moe", "qwen3_5_moe"):  # and a hybrid's MoE layers beside its linear ones
        expected = [o.outputs[0].token_ids for o in LLM(str(tiny_dir(family)), block_size=8).generate(
            prompts, params, use_tqdm=False)]
        offloaded = LLM(str(tiny_dir(family)), block_size=8, moe_gpu_experts=2)  # 2 of 4 experts resident
        assert [o.outputs[0].token_ids for o in offloaded.generate(prompts, params, use_tqdm=False)] == expected
        caches = [m.expert_cache for m in offloaded.engine.model.modules() if isinstance(m, SparseMoE)]
        assert caches and all(c.slots == 2 and c.misses > 2 and c.hits > 0 for c in caches)  # evictions happened
        assert all(c.next is not None for c in caches[:-1])  # each MoE layer copies ahead for the next one
        if family != "qwen2_moe":  # (the tiny Qwen2-MoE has one MoE layer)
            assert len(caches) > 1 and sum(c.prefetched for c in caches) > 0
        assert not any("w_gate_up" in name for name, _ in offloaded.engine.model.named_parameters())
    with pytest.raises(ValueError, match="moe_gpu_experts is set but the model has no MoE layers"):
        LLM(str(tiny_dir("llama")), moe_gpu_experts=2)


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
def test_experts_computed_where_they_live_agree_with_the_resident_model(family, tiny_gguf, tiny_dir):
    """moe_cpu_compute: 2 of 4 experts per layer on the device, the other 2 computed by the host's kernels (a GGUF's
    repacked for them; float stacks by the torch reference): the resident model's greedy tokens, logprobs within
    fp32 rounding of the sums' other order, host pairs really computed there."""
    from backend import LLM, SamplingParams
    from backend.models.moe import SparseMoE
    from backend.models.split_experts import SplitExperts
    from tests.backend.conftest import prompts_of_lengths

    prompts = prompts_of_lengths(5, 23)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=1)
    for model in (str(tiny_gguf(family)[0]), str(tiny_dir(family))):
        resident = LLM(model, block_size=8).generate(prompts, params, use_tqdm=False)
        split = LLM(model, block_size=8, moe_gpu_experts=2, moe_cpu_compute=True)
        outs = split.generate(prompts, params, use_tqdm=False)
        chosen = lambda out: torch.tensor([lp[t].logprob for lp, t in zip(out.logprobs, out.token_ids)])  # noqa: E731
        for want, got in zip(resident, outs):
            assert got.outputs[0].token_ids == want.outputs[0].token_ids
            torch.testing.assert_close(chosen(got.outputs[0]), chosen(want.outputs[0]), atol=1e-4, rtol=0)
        layers = [m.expert_cache for m in split.engine.model.modules() if isinstance(m, SparseMoE)]
        assert layers and all(isinstance(c, SplitExperts) and c.slots == 2 and c.host_pairs > 0 for c in layers)
        assert all(d.shape[0] == 2 for c in layers for d in c.dev)
    with pytest.raises(ValueError, match="moe_cpu_compute computes the experts kept in host memory"):
        LLM(str(tiny_dir(family)), moe_cpu_compute=True)
