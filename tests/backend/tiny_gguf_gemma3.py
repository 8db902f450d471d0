"""Tiny gemma3 GGUF files, written with gguf.GGUFWriter as llama.cpp's convert_hf_to_gguf.py lays them out
(Gemma3Model; names and keys from gguf-py's constants): every norm stored as 1 + w, the embedding's rows cut to
the tokenizer's (the converter drops the rows past len(vocab) + len(added_tokens)), tied output, no key for the
5:1 layer pattern nor the local layers' rotary base (llama.cpp's own constants), a linearly scaled global base.
The reference is the same Hugging Face model with the file's weights as they decode (tiny_gguf._store), its
vocabulary cut as the file's."""

import json
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType as T
from gguf import GGUFWriter, RopeScalingType
from safetensors.torch import load_file, save_file

from tests.backend.tiny_gguf import _store
from tests.backend.tiny_models import GEMMA3_ROPE, build_model

# llama.cpp's gemma3 pattern (five sliding layers, then a full one); widths that hold whole 256-blocks; q . k scaled
# by head_dim ** -0.5, as llama.cpp scales every release but the 27B (the file cannot say otherwise)
SHAPES = dict(
    hidden_size=256,
    intermediate_size=512,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    query_pre_attn_scalar=64,
    num_hidden_layers=6,
    sliding_window=12,
    layer_types=["sliding_attention"] * 5 + ["full_attention"],
    rope_parameters=GEMMA3_ROPE,
)
POLICIES = {
    "F32": {},
    # Q4_K_M's choice of formats: Q6_K for v and down, Q4_K elsewhere
    "Q4_K_M": {
        "token_embd": "Q6_K",
        "attn_q": "Q4_K",
        "attn_k": "Q4_K",
        "attn_v": "Q6_K",
        "attn_output": "Q4_K",
        "ffn_gate": "Q4_K",
        "ffn_up": "Q4_K",
        "ffn_down": "Q6_K",
    },
}
_NAMES = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def _metadata(w: GGUFWriter, cfg: dict, hf_dir: Path) -> None:
    full = cfg["rope_parameters"]["full_attention"]
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_key_length(cfg["head_dim"])
    w.add_value_length(cfg["head_dim"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_freq_base(full["rope_theta"])  # the global layers'
    if full.get("rope_type") == "linear":
        w.add_rope_scaling_type(RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(full["factor"])
    w.add_sliding_window(cfg["sliding_window"])
    if cfg.get("final_logit_softcapping"):
        w.add_final_logit_softcapping(cfg["final_logit_softcapping"])
    w.add_vocab_size(cfg["vocab_size"])
    tok = json.loads((hf_dir / "tokenizer.json").read_text())
    tokens = [t for t, _ in sorted(tok["model"]["vocab"].items(), key=lambda kv: kv[1])]
    special = {a["content"] for a in tok["added_tokens"]}
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens + [f"[PAD{i}]" for i in range(len(tokens), cfg["vocab_size"])])
    w.add_token_types([3 if t in special else 1 for t in tokens] + [4] * (cfg["vocab_size"] - len(tokens)))
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]])
    w.add_bos_token_id(cfg["bos_token_id"])
    w.add_eos_token_id(cfg["eos_token_id"])
    w.add_chat_template(
        json.loads((hf_dir / "tokenizer_config.json").read_text()).get("chat_template")
        or (hf_dir / "chat_template.jinja").read_text()
    )


def write_gguf(policy: str, root: Path, **overrides) -> tuple[Path, Path]:
    """(the GGUF file, a Hugging Face directory of the same model with its weights as the file decodes them)."""
    hf_dir = build_model("gemma3", root / f"gemma3-{policy}-hf", **{**SHAPES, **overrides})
    cfg = json.loads((hf_dir / "config.json").read_text())
    tok = json.loads((hf_dir / "tokenizer.json").read_text())
    rows = min(cfg["vocab_size"], len(tok["model"]["vocab"]) + len(tok["added_tokens"]))
    out = root / f"gemma3-{policy}.gguf"
    writer = GGUFWriter(str(out), "gemma3")
    _metadata(writer, cfg, hf_dir)
    ref = {}
    for n, (name, tensor) in enumerate(sorted(load_file(str(hf_dir / "model.safetensors")).items())):
        parts, w = name.split("."), tensor.float().numpy()
        if name == "model.embed_tokens.weight":
            gname, w = "token_embd.weight", w[:rows]
        elif name == "model.norm.weight":
            gname = "output_norm.weight"
        else:
            gname = f"blk.{parts[2]}.{_NAMES['.'.join(parts[3:-1])]}.{parts[-1]}"
        shift = (
            1.0 if name.endswith("norm.weight") else 0.0
        )  # Gemma3RMSNorm's 1 + w, as the converter stores it
        kind = gname.split(".")[-2]
        fmt = POLICIES[policy].get(kind, "F32") if w.ndim == 2 else "F32"
        data, qtype, back = _store(np.ascontiguousarray(w + shift), fmt, n)
        writer.add_tensor(gname, data, raw_dtype=qtype if qtype not in (T.F32, T.F16) else None)
        ref[name] = torch.from_numpy(back.reshape(w.shape) - shift)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    ref_dir = out.with_suffix(".reference")
    ref_dir.mkdir(exist_ok=True)
    for f in hf_dir.iterdir():
        if f.name not in ("model.safetensors", "config.json") and f.is_file():
            (ref_dir / f.name).write_bytes(f.read_bytes())
    (ref_dir / "config.json").write_text(json.dumps({**cfg, "vocab_size": rows}))
    save_file(
        {k: v.contiguous() for k, v in ref.items()},
        str(ref_dir / "model.safetensors"),
        metadata={"format": "pt"},
    )
    return out, ref_dir
