"""Gemma3ForConditionalGeneration checkpoints (the 4B/12B/27B releases) served as text: text_config read with
Gemma3TextConfig's defaults for what the releases leave out and the top level's end tokens, the language model's
weights under either naming, the vision tower and projector left unloaded with one log line."""

import json
import shutil

from safetensors.torch import load_file, save_file

from backend import LLM
from backend.hf_config import from_hf_config
from tests.backend.test_models_vs_transformers import PROMPTS, assert_matches_transformers
from tests.backend.tiny_models import build_gemma3_multimodal

# google/gemma-3-4b-it's config.json as released: text_config names little more than the widths
RELEASED_4B = {
    "architectures": ["Gemma3ForConditionalGeneration"],
    "eos_token_id": [1, 106],
    "model_type": "gemma3",
    "text_config": {
        "hidden_size": 2560,
        "intermediate_size": 10240,
        "model_type": "gemma3_text",
        "num_hidden_layers": 34,
        "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
        "sliding_window": 1024,
    },
    "vision_config": {"hidden_size": 1152, "image_size": 896, "model_type": "siglip_vision_model"},
}


def test_released_text_config_reads_as_transformers_completes_it():
    from transformers import Gemma3TextConfig

    mc = from_hf_config(RELEASED_4B, "gemma-3-4b-it")
    theirs = Gemma3TextConfig(**RELEASED_4B["text_config"])
    assert (mc.vocab_size, mc.num_heads, mc.num_kv_heads, mc.head_dim, mc.max_position_embeddings) == (
        theirs.vocab_size,
        theirs.num_attention_heads,
        theirs.num_key_value_heads,
        theirs.head_dim,
        theirs.max_position_embeddings,
    )
    assert mc.attention_scale == theirs.query_pre_attn_scalar**-0.5
    assert mc.tie_word_embeddings == theirs.tie_word_embeddings and mc.hidden_act == theirs.hidden_activation
    assert [s.attention.kind for s in mc.layers] == [t.removesuffix("_attention") for t in theirs.layer_types]
    assert {s.attention.window for s in mc.layers} == {theirs.sliding_window, None}
    assert mc.rope_scaling == {
        "rope_type": "linear",
        "factor": theirs.rope_parameters["full_attention"]["factor"],
    }
    assert mc.eos_token_ids == [1, 106]  # the top level's: <eos> and <end_of_turn>


def as_transformers_names(source, target):
    """The same checkpoint under transformers 5's module names: model.language_model.*, model.vision_tower.*,
    model.multi_modal_projector.*."""
    shutil.copytree(source, target)
    state = load_file(str(source / "model.safetensors"))
    renamed = {}
    for name, tensor in state.items():
        if name.startswith("language_model.model."):
            name = "model.language_model." + name.removeprefix("language_model.model.")
        elif name.startswith("language_model.lm_head."):
            name = name.removeprefix("language_model.")
        else:
            name = f"model.{name}"
        renamed[name] = tensor
    save_file(renamed, str(target / "model.safetensors"), metadata={"format": "pt"})
    return target


def test_gemma3_multimodal_checkpoint_serves_its_text_as_transformers(tmp_path, hf_model, caplog):
    released = build_gemma3_multimodal(tmp_path / "released")
    assert any(n.startswith("language_model.model.") for n in load_file(str(released / "model.safetensors")))
    reference = hf_model(released)
    assert type(reference).__name__ == "Gemma3ForConditionalGeneration"
    for directory in (released, as_transformers_names(released, tmp_path / "renamed")):
        caplog.clear()
        with caplog.at_level("INFO", logger="backend.weights"):
            llm = LLM(str(directory), block_size=8)
        assert len([r for r in caplog.records if "images are not" in r.getMessage()]) == 1
        assert (
            llm.engine.model.config.eos_token_ids
            == json.loads((released / "config.json").read_text())["eos_token_id"]
        )
        assert_matches_transformers(llm, reference, PROMPTS, 16)
