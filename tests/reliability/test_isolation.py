"""A failure while processing one sequence ends that request with an error and leaves the rest of the
batch exactly as it would have been without it (the oracle: the same requests run without the fault)."""

import pytest

from backend.config import EngineConfig
from backend.engine.llm_engine import LLMEngine
from backend.sampling_params import SamplingParams

PROMPTS = {"greedy": [5, 6, 7, 8, 9], "seeded": [10, 11, 12], "logprobs": [20, 21, 22, 23], "victim": [30, 31]}
PARAMS = {
    "greedy": SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
    "seeded": SamplingParams(temperature=0.9, seed=7, max_tokens=12, ignore_eos=True),
    "logprobs": SamplingParams(temperature=0.8, seed=9, logprobs=2, max_tokens=12, ignore_eos=True),
    "victim": SamplingParams(temperature=0.7, seed=11, max_tokens=12, ignore_eos=True),
}


@pytest.fixture(scope="module")
def engine(tiny_dir):
    return LLMEngine(EngineConfig(model=str(tiny_dir("llama")), block_size=8, max_model_len=128))


def run(engine: LLMEngine, names: list[str], sabotage=None) -> dict:
    for name in names:
        engine.add_request(name, PROMPTS[name], PARAMS[name])
    if sabotage:
        sabotage(engine)
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    return finals


def _same(a, b) -> None:
    assert a.outputs[0].token_ids == b.outputs[0].token_ids
    assert a.outputs[0].text == b.outputs[0].text
    if a.outputs[0].logprobs is not None:
        assert [sorted(e) for e in a.outputs[0].logprobs] == [sorted(e) for e in b.outputs[0].logprobs]


def test_a_detokenizer_failure_ends_only_its_request(engine):
    healthy = ["greedy", "seeded", "logprobs"]
    baseline = run(engine, healthy)

    def break_detokenizer(e):
        (victim,) = e.requests["victim"]
        calls = []

        def add(token):
            calls.append(token)
            if len(calls) == 3:
                raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "simulated")
            return "x"

        victim.detokenizer.add = add

    finals = run(engine, healthy + ["victim"], break_detokenizer)
    assert finals["victim"].outputs[0].finish_reason == "error" and "simulated" in finals["victim"].error
    for name in healthy:
        assert finals[name].error is None
        _same(finals[name], baseline[name])


def test_a_sampling_failure_ends_only_its_request_and_seeded_neighbours_draw_the_same(engine):
    healthy = ["greedy", "seeded", "logprobs"]
    baseline = run(engine, healthy)

    class BrokenMatcher:
        def fill_next_token_bitmask(self, bitmask, index):
            raise RuntimeError("simulated grammar fault")

    def break_sampling(e):
        e.guided_matcher(SamplingParams(guided_json=True))  # the grammar machinery, as a real request sets it up
        (victim,) = e.requests["victim"]
        victim.matcher = BrokenMatcher()

    finals = run(engine, healthy + ["victim"], break_sampling)
    assert finals["victim"].outputs[0].finish_reason == "error" and "grammar fault" in finals["victim"].error
    for name in healthy:
        _same(finals[name], baseline[name])


def test_ignore_eos_with_a_grammar_ends_where_the_grammar_ends(engine):
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, guided_json={"enum": ["ink"]})
    engine.add_request("json", [5, 6, 7], params)
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            final = out
    assert final.error is None
    assert final.outputs[0].finish_reason == "stop" and final.outputs[0].text == '"ink"'


def test_add_request_is_all_or_nothing(engine):
    bad_schema = SamplingParams(n=2, guided_json={"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}})
    with pytest.raises(ValueError):
        engine.add_request("bad", [5, 6], bad_schema)
    with pytest.raises(ValueError, match="top_k must be at most the vocabulary size"):
        engine.add_request("bad", [5, 6], SamplingParams(n=2, top_k=10_000))
    assert "bad" not in engine.requests and not engine.has_unfinished_requests()
    # The seed that made the second sequence overflow: seed + 1 wraps into the 64 bits a generator takes.
    engine.add_request("wrap", [5, 6], SamplingParams(n=2, seed=2**64 - 1, max_tokens=3))
    while engine.has_unfinished_requests():
        engine.step()
    assert not engine.requests
