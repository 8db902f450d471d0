"""The step-wise API as the Nano-vLLM-MS walkthrough writes it (`from backend import ...` the only change), on a
tiny quantized MoE GGUF: its outputs against the offline LLM's on the same model, and each refusal's message."""

import pytest

from backend import LLM, EngineArgs, LLMEngine, SamplingParams

MESSAGES = [{"role": "user", "content": "Who copied the manuscript?"}]
PROMPT = "The scribe copied"
GREEDY = {"temperature": 0.0, "max_tokens": 12, "ignore_eos": True}


def walkthrough_args(path, **overrides) -> EngineArgs:
    settings = dict(
        model=str(path),
        tokenizer=str(path),
        max_model_len=256,
        tensor_parallel_size=1,
        gpu_memory_utilization=0.9,
        quantization="gguf",
        moe_num_experts=4,
        moe_top_k=2,
        enable_cpu_offload=True,
        block_size=8,
    )
    return EngineArgs(**{**settings, **overrides})


def run(engine: LLMEngine) -> dict:
    """The walkthrough's loop: step until nothing is unfinished, keeping every output step() returns."""
    seen: dict[str, list] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            seen.setdefault(out.request_id, []).append(out)
    return seen


def test_the_walkthrough_runs_and_matches_the_offline_api(tiny_gguf):
    path, _ = tiny_gguf("mixtral")
    engine = LLMEngine.from_engine_args(walkthrough_args(path))
    assert engine.moe_gpu_experts is None  # enable_cpu_offload=True is "auto": on the CPU every expert stays
    engine.add_request("chat", MESSAGES, GREEDY)
    engine.add_request("text", PROMPT, SamplingParams(**GREEDY))
    seen = run(engine)

    llm = LLM(str(path), max_model_len=256, block_size=8)
    expected = {
        "chat": llm.chat(MESSAGES, SamplingParams(**GREEDY), use_tqdm=False)[0],
        "text": llm.generate(PROMPT, SamplingParams(**GREEDY), use_tqdm=False)[0],
    }
    for request_id, outs in seen.items():
        final = outs[-1]
        assert final.finished and not any(o.finished for o in outs[:-1])
        assert final.outputs[0].token_ids == expected[request_id].outputs[0].token_ids
        assert final.outputs[0].text == expected[request_id].outputs[0].text
        assert final.prompt == expected[request_id].prompt
        texts = [o.outputs[0].text for o in outs]  # cumulative: each output extends the one before
        assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))
        assert len(final.outputs[0].token_ids) == GREEDY["max_tokens"]
    assert set(seen) == {"chat", "text"}


def test_a_draft_model_becomes_speculative_decoding(tiny_gguf):
    path, _ = tiny_gguf("llama")
    engine = LLMEngine.from_engine_args(
        walkthrough_args(
            path,
            speculative_model=str(path),
            moe_num_experts=None,
            moe_top_k=None,
            speculative_draft_length=3,
        )
    )
    assert engine.spec.method == "draft" and engine.spec.num_tokens == 3
    engine.add_request("0", PROMPT, GREEDY)
    out = run(engine)["0"][-1]
    plain = LLM(str(path), max_model_len=256, block_size=8).generate(
        PROMPT, SamplingParams(**GREEDY), use_tqdm=False
    )
    assert out.outputs[0].token_ids == plain[0].outputs[0].token_ids
    assert engine.stats()["spec_accepted_tokens"] > 0  # the target drafting for itself is always right


def test_moe_settings_are_checked_against_the_file(tiny_gguf):
    path, _ = tiny_gguf("mixtral")
    with pytest.raises(ValueError, match=r"moe_num_experts=8 does not match .*: the model has 4"):
        LLMEngine.from_engine_args(walkthrough_args(path, moe_num_experts=8))
    with pytest.raises(ValueError, match=r"moe_top_k=1 does not match .*: the model has 2"):
        LLMEngine.from_engine_args(walkthrough_args(path, moe_top_k=1))
    dense, _ = tiny_gguf("llama")
    with pytest.raises(ValueError, match=r"moe_num_experts=4 does not match .*the model is dense"):
        LLMEngine.from_engine_args(walkthrough_args(dense))


def test_refusals(tiny_gguf, tmp_path):
    path, ref_dir = tiny_gguf("mixtral")
    with pytest.raises(
        ValueError, match="tensor_parallel_size=2: this engine runs a model on one GPU; .* run vLLM"
    ):
        LLMEngine.from_engine_args(walkthrough_args(path, tensor_parallel_size=2))
    with pytest.raises(ValueError, match="quantization='gguf' needs a .gguf file"):
        LLMEngine.from_engine_args(walkthrough_args(ref_dir))
    with pytest.raises(ValueError, match="quantization 'awq' is not supported"):
        LLMEngine.from_engine_args(walkthrough_args(path, quantization="awq"))
    with pytest.raises(ValueError, match="enable_cpu_offload=True chooses moe_gpu_experts='auto'"):
        LLMEngine.from_engine_args(walkthrough_args(path, moe_gpu_experts=2))
    engine = LLMEngine.from_engine_args(walkthrough_args(path))
    with pytest.raises(ValueError, match="unknown sampling setting.* temprature"):
        engine.add_request("0", PROMPT, {"temprature": 0.5})
    assert not engine.has_unfinished_requests()
