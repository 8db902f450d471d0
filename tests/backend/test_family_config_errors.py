"""A config.json with a key missing, of the wrong type or out of range fails with a ModelLoadError that names the
file and the key, never with a raw KeyError, TypeError or IndexError from inside a family's reader."""

import copy
import json

import pytest
import transformers

from backend import LLM
from backend.hf_config import from_hf_config
from backend.model_config import ModelLoadError
from tests.backend.tiny_models import COMMON, FAMILIES

SOURCE = "probe/config.json"
WRONG_VALUES = ("x", -3, 0, 2.5, [], {}, True)
DROP = object()


def tiny_config(family: str) -> dict:
    """The family's tiny config as config.json holds it, every key spelled out."""
    config_cls, model_cls, overrides = FAMILIES[family]
    config = getattr(transformers, config_cls)(**{**COMMON, **overrides})
    return {**json.loads(config.to_json_string(use_diff=False)), "architectures": [model_cls]}


def changed(family: str, **changes) -> dict:
    cfg = tiny_config(family)
    for key, value in changes.items():
        if value is DROP:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    return cfg


@pytest.mark.parametrize("family", list(FAMILIES))
def test_every_key_dropped_or_mistyped_loads_or_fails_plainly(family):
    base = tiny_config(family)
    from_hf_config(copy.deepcopy(base), SOURCE)
    raw = []
    for key in base:
        for value in (DROP, *WRONG_VALUES):
            cfg = copy.deepcopy(base)
            if value is DROP:
                del cfg[key]
            else:
                cfg[key] = value
            try:
                from_hf_config(cfg, SOURCE)
            except ModelLoadError as e:
                assert str(e).startswith(SOURCE), e
            except Exception as e:  # what is collected here is the failure
                raw.append(f"{key}={'(dropped)' if value is DROP else repr(value)}: {type(e).__name__}: {e}")
    assert not raw, "\n".join(raw)


# family, the change, the key the message must name
CASES = [
    ("llama", dict(hidden_size=DROP), "hidden_size"),
    ("llama", dict(vocab_size=DROP), "vocab_size"),
    ("llama", dict(num_hidden_layers="2"), "num_hidden_layers"),
    ("llama", dict(num_attention_heads=0), "num_attention_heads"),
    ("llama", dict(intermediate_size=-96), "intermediate_size"),
    ("llama", dict(num_key_value_heads=3), "num_key_value_heads"),
    ("llama", dict(eos_token_id="</s>"), "eos_token_id"),
    ("llama", dict(architectures="LlamaForCausalLM"), "architectures"),
    ("llama", dict(rope_parameters="yarn"), "rope_parameters"),
    ("llama3_rope_tied", dict(rope_parameters={"rope_type": "llama3", "factor": "8"}), "factor"),
    ("mixtral", dict(num_experts_per_tok=DROP), "num_experts_per_tok"),
    ("mixtral", dict(num_experts_per_tok=5), "num_experts_per_tok"),
    ("qwen2_moe", dict(moe_intermediate_size=DROP), "moe_intermediate_size"),
    ("qwen2_moe", dict(mlp_only_layers=1), "mlp_only_layers"),
    ("granitemoe", dict(embedding_multiplier="12"), "embedding_multiplier"),
    ("smollm3", dict(no_rope_layers=4), "no_rope_layers"),
    ("phi4_partial_rotary", dict(rope_parameters={"partial_rotary_factor": "half"}), "partial_rotary_factor"),
    ("deepseek_v2", dict(kv_lora_rank=DROP), "kv_lora_rank"),
    ("deepseek_v2", dict(qk_nope_head_dim=-16), "qk_nope_head_dim"),
    ("deepseek_v2", dict(v_head_dim="16"), "v_head_dim"),
    ("deepseek_v2_grouped", dict(routed_scaling_factor="x"), "routed_scaling_factor"),
    ("deepseek_v3", dict(n_group=3), "n_group"),
    ("deepseek_v3", dict(topk_group=8), "topk_group"),
    ("deepseek_v3", dict(n_group="4"), "n_group"),
    ("deepseek_v3", dict(first_k_dense_replace="1"), "first_k_dense_replace"),
    ("deepseek_v3", dict(rope_parameters={"rope_type": "yarn", "factor": [4]}), "factor"),
    ("glm4_moe", dict(num_experts_per_tok=DROP), "num_experts_per_tok"),
    ("qwen3_next", dict(layer_types=["linear_attention"] * 3), "layer_types"),
    ("qwen3_next", dict(layer_types="full_attention"), "layer_types"),
    ("qwen3_next", dict(linear_num_key_heads=0), "linear_num_key_heads"),
    ("qwen3_next", dict(linear_num_value_heads="4"), "linear_num_value_heads"),
    ("qwen3_next", dict(linear_key_head_dim=-16), "linear_key_head_dim"),
    ("qwen3_next", dict(full_attention_interval="4", layer_types=DROP), "full_attention_interval"),
    ("qwen3_5_moe", dict(num_experts_per_tok=DROP), "num_experts_per_tok"),
    ("gpt_oss", dict(num_local_experts=DROP), "num_local_experts"),
    ("gpt_oss", dict(swiglu_limit="7"), "swiglu_limit"),
    ("gpt_oss", dict(layer_types=["full_attention"] * 3), "layer_types"),
    ("gpt_oss", dict(sliding_window=[128]), "sliding_window"),
    ("gemma3", dict(query_pre_attn_scalar=0), "query_pre_attn_scalar"),
    ("gemma3", dict(sliding_window="12"), "sliding_window"),
    ("gemma3", dict(rope_parameters="x"), "rope_parameters"),
    ("gemma3", dict(layer_types=[1, 2, 3, 4, 5, 6]), "layer_types"),
    ("gemma3", dict(final_logit_softcapping="30"), "final_logit_softcapping"),
]


@pytest.mark.parametrize(("family", "changes", "key"), CASES, ids=[f"{c[0]}-{c[2]}" for c in CASES])
def test_bad_key_names_the_file_and_the_key(family, changes, key):
    with pytest.raises(ModelLoadError) as caught:
        from_hf_config(changed(family, **changes), SOURCE)
    message = str(caught.value)
    assert message.startswith(SOURCE) and key in message, message


@pytest.mark.parametrize(
    ("family", "changes", "key"),
    [
        ("deepseek_v2", dict(kv_lora_rank=DROP), "kv_lora_rank"),
        ("qwen3_next", dict(num_hidden_layers=-4), "num_hidden_layers"),
    ],
)
def test_llm_on_a_directory_with_a_bad_config_says_which_key(tmp_path, family, changes, key):
    (tmp_path / "config.json").write_text(json.dumps(changed(family, **changes)))
    with pytest.raises(ModelLoadError, match=key) as caught:
        LLM(str(tmp_path))
    assert str(tmp_path / "config.json") in str(caught.value)


def test_llm_on_a_config_that_is_not_an_object(tmp_path):
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(ModelLoadError, match="JSON object"):
        LLM(str(tmp_path))


@pytest.mark.parametrize(
    ("text", "message"),
    [("{not json", "not valid JSON"), ("[2]", "must be a JSON object"),
     ('{"eos_token_id": "2"}', "eos_token_id is '2'; it must be a token id")],
)
def test_a_bad_generation_config_is_named_with_what_is_wrong(tiny_dir, tmp_path, text, message):
    """generation_config.json is read beside config.json for its end tokens: a broken one is refused by its path."""
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        if (tiny_dir("llama") / name).exists():
            (tmp_path / name).write_text((tiny_dir("llama") / name).read_text())
    (tmp_path / "generation_config.json").write_text(text)
    with pytest.raises(ModelLoadError, match=message) as caught:
        LLM(str(tmp_path))
    assert str(tmp_path / "generation_config.json") in str(caught.value)
