"""RoPE scaling we add past the trained context leaves short requests exact (engine/rope_switch.py).

A tiny llama trained at 64 positions, served at 256 with YaRN x4 (as `smollm2` is served at 32k): a sequence of at
most 64 tokens must give transformers' unscaled model's tokens and logprobs, a longer one the YaRN model's over the
whole sequence, the one that grows past 64 switching (recomputed once); both kinds in one batch, and never each
other's cached blocks, in memory or on disk."""

import pytest
import torch

from backend import LLM, SamplingParams
from backend.context_length import fit_context
from backend.loader import locate, read_config
from tests.backend.conftest import interpreted_only, prompts_of_lengths
from tests.backend.test_longrope import LONGROPE, TRAINED
from tests.backend.test_models_vs_transformers import prefill_logits
from tests.backend.tiny_models import build_model

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
SERVED = dict(block_size=8, max_model_len=256)  # past the 64 trained positions: YaRN x4 with a switch at 64
GREEDY = SamplingParams(temperature=0, max_tokens=20, logprobs=0, ignore_eos=True)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(the checkpoint trained at 64 positions, transformers' model of it, transformers' YaRN x4 model of it)."""
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("rope_switch")
    plain = build_model("llama", root / "plain", max_position_embeddings=64)
    yarn = build_model("llama", root / "yarn", rope_scaling=dict(YARN))  # the same weights (seeded by family)
    load = lambda d: AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32).eval()  # noqa: E731
    return plain, load(plain), load(yarn)


@pytest.fixture(autouse=True)
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("SCRIPTORIUM_HOME", str(tmp_path))


def reference_logprobs(unscaled, scaled, ids: list[int]) -> torch.Tensor:
    """transformers' next-token logprobs over the whole sequence: unscaled within 64 tokens, scaled past them."""
    with torch.no_grad():
        logits = (unscaled if len(ids) <= 64 else scaled)(torch.tensor([ids])).logits[0, -1]
    return torch.log_softmax(logits.float(), dim=-1)


def assert_generation_matches(out, prompt: list[int], unscaled, scaled) -> None:
    ids = list(prompt)
    for token, entry in zip(out.outputs[0].token_ids, out.outputs[0].logprobs, strict=True):
        expected = reference_logprobs(unscaled, scaled, ids)
        where = f"at {len(ids)} tokens"
        assert token == int(expected.argmax()), where
        assert entry[token].logprob == pytest.approx(expected[token].item(), abs=1e-4), where
        ids.append(token)


def test_the_switch_is_for_scaling_the_checkpoint_did_not_ask_for(models, tmp_path):
    plain, _, _ = models
    config, _ = read_config(locate(str(plain)))
    for setting, length in ((None, 256), ("yarn:4", None), ({"rope_type": "linear", "factor": 4}, None)):
        served, _ = fit_context(config, setting, length)
        assert (served.rope_switch_length, served.short_rope_scaling) == (64, None)
    # within the trained length: no scaling, no switch
    assert fit_context(config, None, 64)[0].rope_switch_length is None
    # A checkpoint's own YaRN applies at every length, as transformers applies it
    yarn_config, _ = read_config(locate(str(build_model("llama", tmp_path / "own", rope_scaling=dict(YARN)))))
    assert fit_context(yarn_config, None, 256)[0].rope_switch_length is None
    # LongRoPE: its short factors up to the trained length where the engine serves past it
    longrope, _ = read_config(locate(str(build_model("phi3", tmp_path / "phi3", **LONGROPE))))
    served, _ = fit_context(longrope, None, 256)
    assert served.rope_switch_length == TRAINED and served.rope_scaling["long"]
    assert served.short_rope_scaling == {**served.rope_scaling, "long": False}
    assert fit_context(longrope, None, TRAINED)[0].rope_switch_length is None


def test_short_and_long_prompts_in_one_batch_match_the_unscaled_and_the_scaled_model(models):
    plain, unscaled, scaled = models
    llm = LLM(str(plain), **SERVED)
    prompts = prompts_of_lengths(17, 64, 70, 100)  # one step of at most 256 tokens
    for prompt, ours in zip(prompts, prefill_logits(llm, prompts)):
        with torch.no_grad():
            expected = (unscaled if len(prompt) <= 64 else scaled)(torch.tensor([prompt])).logits[0]
            other = (scaled if len(prompt) <= 64 else unscaled)(torch.tensor([prompt])).logits[0]
        torch.testing.assert_close(ours, expected, atol=1e-4, rtol=1e-4)
        assert (ours - other).abs().max() > 1e-2  # the two models differ where it is checked


def test_a_sequence_growing_past_the_trained_length_switches_once_beside_short_and_long_ones(models):
    plain, unscaled, scaled = models
    llm = LLM(str(plain), **SERVED)
    prompts = prompts_of_lengths(30, 56, 100)  # stays within 64, grows past it, starts past it
    for prompt, out in zip(prompts, llm.generate(prompts, GREEDY, use_tqdm=False)):
        assert_generation_matches(out, prompt, unscaled, scaled)
    assert llm.engine.scheduler.num_preemptions == 1  # the 56-token prompt's, at its 65th token


def test_cached_blocks_serve_only_their_own_kind_in_memory_and_on_disk(models):
    plain, unscaled, scaled = models
    short = prompts_of_lengths(40)[0]  # 60 tokens with its 20 new ones: short throughout
    longer, also_short = short + prompts_of_lengths(60)[0], short + [5, 6, 7, 8]
    first = LLM(str(plain), **SERVED)
    first.generate(short, GREEDY, use_tqdm=False)
    [out] = first.generate(longer, GREEDY, use_tqdm=False)
    assert out.num_cached_tokens == 0  # the short prompt's blocks are not the scaled kind's
    assert_generation_matches(out, longer, unscaled, scaled)
    [out] = first.generate(also_short, GREEDY, use_tqdm=False)
    assert out.num_cached_tokens == 40
    assert_generation_matches(out, also_short, unscaled, scaled)
    assert first.engine.disk_cache.flush(60)

    restarted = LLM(str(plain), **SERVED)
    [out] = restarted.generate(longer, GREEDY, use_tqdm=False)
    assert out.num_cached_tokens == 96  # its own kind's 12 blocks from disk
    assert_generation_matches(out, longer, unscaled, scaled)
    [out] = restarted.generate(also_short, GREEDY, use_tqdm=False)
    assert out.num_cached_tokens == 40 and restarted.engine.disk_cache.loaded_tokens == 96 + 40
    assert_generation_matches(out, also_short, unscaled, scaled)


@interpreted_only
def test_the_cuda_path_switches_as_the_cpu_path(models, monkeypatch):
    from tests.backend.cuda_emulation import capture_graphs, emulate_cuda, replays

    plain, unscaled, scaled = models
    prompts = prompts_of_lengths(30, 56)
    emulate_cuda(monkeypatch)
    llm = LLM(str(plain), **{**SERVED, "block_size": 16}, max_num_seqs=4)
    [runner] = capture_graphs(llm)
    for prompt, out in zip(prompts, llm.generate(prompts, GREEDY, use_tqdm=False)):
        assert_generation_matches(out, prompt, unscaled, scaled)
    assert replays(runner) > 0 and llm.engine.scheduler.num_preemptions == 1
