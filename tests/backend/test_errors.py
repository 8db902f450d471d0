"""Bad input gets an error that names what is wrong and what to change."""

import json
import shutil

import pytest

from backend import LLM, SamplingParams
from backend.model_config import ModelLoadError
from backend.model_store import ModelStoreError


@pytest.mark.parametrize("field,value,allowed", [
    ("temperature", -0.1, ">= 0"),
    ("top_p", 0.0, "in (0, 1]"),
    ("top_p", 1.5, "in (0, 1]"),
    ("top_k", -3, "an integer >= 1"),
    ("min_p", 1.2, "in [0, 1]"),
    ("max_tokens", 0, "an integer >= 1"),
    ("n", 0, "an integer >= 1"),
    ("presence_penalty", 3.0, "in [-2, 2]"),
    ("frequency_penalty", -2.5, "in [-2, 2]"),
    ("repetition_penalty", 0.0, "> 0"),
    ("logprobs", 50, "in [0, 20]"),
    ("stop", [""], "non-empty string"),
    ("stop_token_ids", [-1], "token ids >= 0"),
])
def test_invalid_sampling_params_name_the_field_and_range(field, value, allowed):
    with pytest.raises(ValueError) as err:
        SamplingParams(**{field: value})
    assert field in str(err.value) and allowed in str(err.value)


@pytest.fixture(scope="module")
def llm(tiny_dir):
    return LLM(str(tiny_dir("llama")), block_size=8, max_model_len=64)


def test_prompt_longer_than_max_model_len(llm):
    with pytest.raises(ValueError, match="maximum context length is 64 tokens, but the prompt has 80 tokens"):
        llm.generate([5] * 80, SamplingParams(), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


def test_a_validated_request_is_queued_as_it_is(llm, monkeypatch):
    """validate_request is the one check: add_request takes its result without looking at the prompt again, and
    the request runs as the same prompt given raw."""
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    expected = llm.generate([[3, 9, 4, 7]], params, use_tqdm=False)[0].outputs[0].token_ids
    request = engine.validate_request([3, 9, 4, 7], params)
    with pytest.raises(ValueError, match="carries its own params"):
        engine.add_request("twice", request, params)
    with pytest.raises(ValueError, match=r"prompt\[2\]: token ids must be integers"):
        engine.validate_request([1, 99999], params, param="prompt[2]")

    def looked_again(*args, **kwargs):
        raise AssertionError("add_request checked an admitted request again")

    monkeypatch.setattr(engine.limits, "prompt_ids", looked_again)
    monkeypatch.setattr(engine.limits, "check", looked_again)
    engine.add_request("admitted", request)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += [o for o in engine.step() if o.finished]
    assert [o.outputs[0].token_ids for o in outputs] == [expected]


def test_bad_prompts(llm):
    with pytest.raises(ValueError, match="empty"):
        llm.generate([[]], SamplingParams(), use_tqdm=False)
    with pytest.raises(ValueError, match=r"token ids must be integers in \[0, 512\)"):
        llm.generate([[3, 9999]], SamplingParams(), use_tqdm=False)
    with pytest.raises(ValueError, match="2 SamplingParams for 3 prompts"):
        llm.generate([[3], [4], [5]], [SamplingParams(), SamplingParams()], use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


def test_generation_stops_at_max_model_len(llm):
    out = llm.generate([5] * 60, SamplingParams(max_tokens=None, ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 4 and out.finish_reason == "length"


def test_unsupported_architecture_lists_the_supported_ones(tiny_dir, tmp_path):
    shutil.copytree(tiny_dir("llama"), tmp_path / "m")
    cfg_path = tmp_path / "m" / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    cfg_path.write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError) as err:
        LLM(str(tmp_path / "m"))
    assert "GPT2LMHeadModel is not supported" in str(err.value)
    assert "Qwen3MoeForCausalLM" in str(err.value) and str(cfg_path) in str(err.value)


def test_missing_and_corrupt_weights_name_the_file(tiny_dir, tmp_path):
    shutil.copytree(tiny_dir("llama"), tmp_path / "m")
    weights = tmp_path / "m" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    with pytest.raises(ModelLoadError, match=f"{weights}.*corrupt"):
        LLM(str(tmp_path / "m"))
    weights.unlink()
    with pytest.raises(ModelLoadError, match="no \\*.safetensors weights found"):
        LLM(str(tmp_path / "m"))


def test_weights_that_do_not_match_the_config(tiny_dir, tmp_path):
    shutil.copytree(tiny_dir("llama"), tmp_path / "m")
    cfg_path = tmp_path / "m" / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["intermediate_size"] = 100
    cfg_path.write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match=r"mlp\.\w+_proj\.weight' has shape .* the model expects .* does config.json belong"):
        LLM(str(tmp_path / "m"))


def test_corrupt_gguf_names_the_file(tmp_path):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + b"\x00" * 64)
    with pytest.raises(ModelLoadError, match=f"{bad}: not a readable GGUF file"):
        LLM(str(bad))


def test_unknown_model_dtype_and_device(tiny_dir, tmp_path):
    with pytest.raises(ModelStoreError, match="neither a known alias \\(smollm2\\) nor an existing path"):
        LLM("no-such-model")
    with pytest.raises(ModelLoadError, match="no config.json and no .gguf file"):
        LLM(str(tmp_path))
    with pytest.raises(ValueError, match="dtype 'float8' is not supported; use auto"):
        LLM(str(tiny_dir("llama")), dtype="float8")
    with pytest.raises(ValueError, match="float16 is not supported on the CPU"):
        LLM(str(tiny_dir("llama")), device="cpu", dtype="float16")
    import torch

    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="PyTorch sees no CUDA GPU"):
            LLM(str(tiny_dir("llama")), device="cuda")
    with pytest.raises(ValueError, match="max_num_seqs must be an integer >= 1"):
        LLM(str(tiny_dir("llama")), max_num_seqs=0)
    with pytest.raises(ValueError, match="kv_cache_memory must be a fraction"):
        LLM(str(tiny_dir("llama")), kv_cache_memory=1.5)


def test_bfloat16_runs_on_the_cpu(tiny_dir):
    llm = LLM(str(tiny_dir("qwen3")), dtype="bfloat16", block_size=8)
    assert llm.engine.model.lm_head.weight.dtype.is_floating_point
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4
