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
from safetensors.torch import load_file

from tests.backend import tiny_gguf
from tests.backend.tiny_gguf import LAYER_NAMES, _store
from tests.backend.tiny_gguf_parts import add_tokenizer, add_widths, close, write_reference
from tests.backend.tiny_models import GEMMA3_ROPE, build_model

# llama.cpp's gemma3 pattern (five sliding layers, then a full one); widths that hold whole 256-blocks; q . k scaled
# by head_dim ** -0.5, as llama.cpp scales every release but the 27B (the file cannot say otherwise)
SHAPES = dict(
    tiny_gguf.SHAPES,
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
    **LAYER_NAMES,
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}


def _metadata(w: GGUFWriter, cfg: dict, hf_dir: Path) -> None:
    full = cfg["rope_parameters"]["full_attention"]
    add_widths(w, cfg)
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_key_length(cfg["head_dim"])
    w.add_value_length(cfg["head_dim"])
    w.add_rope_freq_base(full["rope_theta"])  # the global layers'
    if full.get("rope_type") == "linear":
        w.add_rope_scaling_type(RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(full["factor"])
    w.add_sliding_window(cfg["sliding_window"])
    if cfg.get("final_logit_softcapping"):
        w.add_final_logit_softcapping(cfg["final_logit_softcapping"])
    add_tokenizer(w, cfg, hf_dir)


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
    close(writer)
    return out, write_reference(out, hf_dir, ref, config={**cfg, "vocab_size": rows})
