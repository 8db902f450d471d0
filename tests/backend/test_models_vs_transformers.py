"""Every supported architecture against transformers on a tiny random-weight checkpoint."""

import pytest
import torch

from backend import LLM, SamplingParams
from tests.backend.conftest import hf_greedy, prompts_of_lengths
from tests.backend.tiny_models import FAMILIES

PROMPTS = prompts_of_lengths(3, 17, 33, 50)  # block_size 8: prompts end inside, at and across block edges


def prefill_logits(llm: LLM, prompts: list[list[int]]) -> list[torch.Tensor]:
    """All prompts scheduled as one batch through the engine's scheduler, runner and paged cache."""
    engine = llm.engine
    for i, prompt in enumerate(prompts):
        engine.add_request(f"logits-{i}", prompt, SamplingParams(max_tokens=1))
    batch = engine.scheduler.schedule()
    assert [item.num_scheduled_tokens for item in batch] == [len(p) for p in prompts]
    input_ids, positions, meta, inputs = engine.runner.prepare(batch)
    with torch.inference_mode():
        logits = engine.model.compute_logits(engine.model(input_ids, positions, meta))
    for i in range(len(prompts)):
        engine.abort_request(f"logits-{i}")
    return [logits[rows] for rows in inputs.hidden_rows]


def assert_logits_match(llm: LLM, reference, prompts: list[list[int]], batched: bool = True,
                        tolerance: float = 1e-4) -> list[torch.Tensor]:
    """Each prompt's prefill logits within `tolerance` of transformers' (the prompts as one batch, or one at a time
    where the engine's budget is short); returns ours."""
    logits = prefill_logits(llm, prompts) if batched else [prefill_logits(llm, [p])[0] for p in prompts]
    for prompt, ours in zip(prompts, logits):
        with torch.no_grad():
            expected = reference(torch.tensor([prompt])).logits[0]
        torch.testing.assert_close(ours, expected, atol=tolerance, rtol=tolerance)
    return logits


# The hybrids' bound: their chunked delta rule carries a last-bit difference in a norm's output (our C RMSNorm and
# torch's reduction sum the squares in another order; both within 2e-7 of float64) about 100 times further over a
# 50-token prompt. Measured on an AVX2 CPU (qwen3_5_moe): 1.2e-4 with our C norm, 8e-6 with torch's; the shorter
# prompts stay within 3e-5. The greedy tokens must still be transformers'.
HYBRID_TOLERANCE = 2e-4


def assert_matches_transformers(llm: LLM, reference, prompts: list[list[int]], new_tokens: int,
                                batched: bool = True) -> list[torch.Tensor]:
    """assert_logits_match, and each prompt's greedy tokens the same; returns our logits."""
    logits = assert_logits_match(llm, reference, prompts, batched)
    greedy = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    for prompt, out in zip(prompts, llm.generate(prompts, greedy, use_tqdm=False)):
        assert out.outputs[0].token_ids == hf_greedy(reference, prompt, new_tokens)
    return logits


def assert_each_piece_matters(llm: LLM, reference, changed: dict, window: int) -> None:
    """PROMPTS' prefill logits within 1e-4 of transformers' and more than 1e-2 from each model in `changed` (the
    reference with one piece changed, by name), so that ignoring any piece would fail; "no window" is not compared
    on prompts within the window, where every position sees the whole prompt either way."""
    for prompt, ours in zip(PROMPTS, prefill_logits(llm, PROMPTS)):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            torch.testing.assert_close(ours, reference(ids).logits[0], atol=1e-4, rtol=1e-4)
            for what, model in changed.items():
                if what == "no window" and len(prompt) <= window:
                    continue
                assert (ours - model(ids).logits[0]).abs().max() > 1e-2, what


@pytest.mark.parametrize("family", list(FAMILIES))
def test_prefill_logits_and_greedy_match_transformers(family, tiny_dir, hf_model):
    directory = tiny_dir(family)
    reference = hf_model(directory)
    # A hybrid model's prompt stops at its last block edge for a state snapshot (engine/state_snapshots.py), a
    # second step; without prefix caching each prompt is one chunk, as prefill_logits reads them. The snapshots
    # are checked against transformers in test_hybrid_prefix.py.
    hybrid = family in ("qwen3_next", "qwen3_5_moe")
    llm = LLM(str(directory), block_size=8, enable_prefix_caching=not hybrid)

    assert_logits_match(llm, reference, PROMPTS, tolerance=HYBRID_TOLERANCE if hybrid else 1e-4)
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks

    outputs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True), use_tqdm=False)
    for prompt, out in zip(PROMPTS, outputs):
        assert out.prompt_token_ids == prompt
        assert out.outputs[0].token_ids == hf_greedy(reference, prompt, 32)
        assert out.outputs[0].finish_reason == "length"


def test_chunked_prefill_matches_transformers(tiny_dir, hf_model):
    """A token budget smaller than the prompts: prompts are computed in chunks across steps, beside decodes."""
    directory = tiny_dir("qwen3")
    llm = LLM(str(directory), block_size=8, max_num_batched_tokens=12)
    outputs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), use_tqdm=False)
    reference = hf_model(directory)
    for prompt, out in zip(PROMPTS, outputs):
        assert out.outputs[0].token_ids == hf_greedy(reference, prompt, 20)


def test_sharded_checkpoint_loads(tiny_dir, hf_model, tmp_path):
    reference = hf_model(tiny_dir("llama"))
    reference.save_pretrained(str(tmp_path), max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        (tmp_path / name).write_bytes((tiny_dir("llama") / name).read_bytes())
    llm = LLM(str(tmp_path), block_size=8)
    out = llm.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    assert out[0].outputs[0].token_ids == hf_greedy(reference, PROMPTS[1], 8)
