"""Structured output: even a random-weight model writes JSON that parses and matches the schema."""

import json

import jsonschema
import pytest

from backend import LLM, SamplingParams
from backend.sampling_params import InvalidParameter
from tests.backend.conftest import prompts_of_lengths

OUTLINE = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 40},
        "sections": {"type": "array", "minItems": 2, "maxItems": 3, "items": {
            "type": "object",
            "properties": {"heading": {"type": "string", "maxLength": 30},
                           "points": {"type": "array", "minItems": 1, "maxItems": 2,
                                      "items": {"type": "string", "maxLength": 30}}},
            "required": ["heading", "points"], "additionalProperties": False}},
        "year": {"type": "integer", "minimum": 0, "maximum": 3000},
    },
    "required": ["title", "sections", "year"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def llm(tiny_dir):
    # Block size 16: the smallest CUDA accepts, so that the module runs on a GPU machine as on the CPU.
    return LLM(str(tiny_dir("llama")), block_size=16, max_model_len=512)


def test_schema_output_parses_and_validates(llm):
    prompts = prompts_of_lengths(4, 19, 33)
    params = [SamplingParams(temperature=t, seed=3, max_tokens=400, guided_json=OUTLINE) for t in (0, 0.8, 1.2)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    for out in outs:
        completion = out.outputs[0]
        assert completion.finish_reason == "stop", completion.text
        jsonschema.validate(json.loads(completion.text), OUTLINE)
    plain = llm.generate(prompts[0], SamplingParams(temperature=0, max_tokens=40), use_tqdm=False)[0].outputs[0]
    with pytest.raises(json.JSONDecodeError):
        json.loads(plain.text)  # the constraint did the work, not the model


def test_any_json_and_n_siblings(llm):
    out = llm.generate(prompts_of_lengths(9)[0], SamplingParams(n=2, temperature=1.0, seed=1, max_tokens=200,
                                                                guided_json=True), use_tqdm=False)[0]
    for completion in out.outputs:
        if completion.finish_reason == "stop":
            json.loads(completion.text)
        else:  # ran out of tokens inside a long value: still a valid prefix of JSON
            assert completion.finish_reason == "length" and completion.text[:1] in "{["


def test_bad_schema_is_refused_naming_the_field(llm):
    with pytest.raises(InvalidParameter) as err:
        llm.generate([3, 4], SamplingParams(guided_json={"type": "object", "properties": {"a": {"$ref": "#/nope"}}}),
                     use_tqdm=False)
    assert err.value.param == "guided_json"
    with pytest.raises(InvalidParameter, match="guided_json must be a JSON schema"):
        SamplingParams(guided_json="{not json")
    assert not llm.engine.has_unfinished_requests()


def test_compiled_grammars_are_an_lru_with_a_cap(tiny_dir):
    from backend.engine.guided import GuidedDecoding
    from backend.loader import load_tokenizer, locate

    guided = GuidedDecoding(load_tokenizer(locate(str(tiny_dir("llama")))), 512, max_grammars=2)
    schemas = [{"type": "object", "properties": {name: {"type": "integer"}}} for name in ("a", "b", "c")]
    guided.matcher(schemas[0])
    guided.matcher(schemas[1])
    guided.matcher(schemas[0])  # used again: the most recent now
    guided.matcher(schemas[2])  # evicts b, the least recently used
    assert guided.num_grammars == 2
    assert list(guided._grammars) == [json.dumps(schemas[0]), json.dumps(schemas[2])]


def test_properties_come_out_in_the_schemas_order(llm):
    """As OpenAI's structured outputs do (and a tool call's name before its arguments)."""
    schema = {"type": "object", "properties": {"zeta": {"type": "boolean"}, "alpha": {"enum": ["x", "y"]}},
              "required": ["zeta", "alpha"], "additionalProperties": False}
    out = llm.generate(prompts_of_lengths(5), SamplingParams(temperature=0, max_tokens=60, guided_json=schema),
                       use_tqdm=False)[0].outputs[0]
    assert out.text.startswith('{"zeta": ') and list(json.loads(out.text)) == ["zeta", "alpha"]


def test_the_mask_meets_the_logits_on_their_device(tiny_dir, monkeypatch):
    """On CUDA the logits live on the card while the matchers fill their mask on the host; xgrammar refuses to
    apply a mask from another device. Here the logits sit on the meta device, another device than the host's
    (xgrammar's apply is recorded: it cannot compute there); on a GPU the tests above run it for real."""
    from types import SimpleNamespace

    import torch
    import xgrammar

    from backend.engine.guided import GuidedDecoding
    from backend.loader import load_tokenizer, locate

    guided = GuidedDecoding(load_tokenizer(locate(str(tiny_dir("llama")))), 512)
    matchers = [None, guided.matcher(True)]
    applied = []
    monkeypatch.setattr(guided, "xgr", SimpleNamespace(
        allocate_token_bitmask=xgrammar.allocate_token_bitmask,
        apply_token_bitmask_inplace=lambda logits, mask, **kw: applied.append((logits.device, mask.device, kw))))
    guided.mask(torch.empty(2, 512, device="meta"), matchers)
    assert applied == [(torch.device("meta"), torch.device("meta"), {"vocab_size": 512, "indices": [1]})]
