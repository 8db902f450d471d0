"""Tiny deepseek2 and glm4moe GGUF files, written with gguf.GGUFWriter as llama.cpp's convert_hf_to_gguf.py lays
them out (DeepseekV2Model, Glm4MoeModel; names and keys from gguf-py's constants): deepseek2 with kv_b_proj as one
attn_kv_b (the converter's older files) or split into attn_k_b (transposed per head) and attn_v_b, MQA head counts
and the absorbed key/value lengths; glm4moe with its multi-token-prediction layer after the others. The reference
is the same Hugging Face model with the file's weights as they decode (tiny_gguf._store)."""

import json
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType as T
from gguf import GGUFWriter, RopeScalingType
from safetensors import safe_open

from tests.backend.tiny_gguf import LAYER_NAMES, SHAPES, _store
from tests.backend.tiny_gguf_parts import add_tokenizer, add_widths, close, write_reference
from tests.backend.tiny_models import V3_YARN, build_model

# Widths that hold whole 256-blocks where K-quants are asked for (else _store falls back to Q8_0, 32-blocks)
MLA_SHAPES = dict(
    SHAPES,
    moe_intermediate_size=256,
    num_key_value_heads=4,
    kv_lora_rank=64,
    qk_nope_head_dim=32,
    qk_rope_head_dim=16,
    v_head_dim=32,
)
BUILDS = {  # variant -> (family of tiny_models.py, its overrides)
    "deepseek2_v2": ("deepseek_v2", dict(MLA_SHAPES, q_lora_rank=None)),
    # V2's group-limited softmax router (expert_group_count, no gating func: softmax) and a leading dense layer
    "deepseek2_v2_grouped": ("deepseek_v2_grouped", dict(MLA_SHAPES, q_lora_rank=None)),
    # V3's router and YaRN (mscale equal to mscale_all_dim: the file keeps one of them)
    "deepseek2_v3": (
        "deepseek_v3",
        dict(MLA_SHAPES, q_lora_rank=64, rope_parameters={**V3_YARN, "mscale": 0.8, "mscale_all_dim": 0.8}),
    ),
    "glm4moe": (
        "glm4_moe",
        dict(SHAPES, moe_intermediate_size=256, head_dim=64, num_nextn_predict_layers=1),
    ),
}
POLICY = {
    "token_embd": "Q8_0",
    "output": "Q6_K",
    "attn_q": "Q4_K",
    "attn_k": "Q4_K",
    "attn_v": "Q6_K",
    "attn_output": "Q4_K",
    "attn_q_a": "Q5_K",
    "attn_q_b": "Q8_0",
    "attn_kv_a_mqa": "Q4_K",
    "attn_kv_b": "Q8_0",
    "attn_k_b": "Q8_0",
    "attn_v_b": "Q8_0",
    "ffn_gate": "Q4_K",
    "ffn_up": "Q4_K",
    "ffn_down": "Q6_K",
    "ffn_gate_exps": "Q4_K",
    "ffn_up_exps": "Q4_K",
    "ffn_down_exps": "Q6_K",
    "ffn_gate_shexp": "Q5_K",
    "ffn_up_shexp": "Q5_K",
    "ffn_down_shexp": "Q8_0",
}
_NAMES = {
    **LAYER_NAMES,
    "self_attn.q_a_proj": "attn_q_a",
    "self_attn.q_a_layernorm": "attn_q_a_norm",
    "self_attn.q_b_proj": "attn_q_b",
    "self_attn.kv_a_proj_with_mqa": "attn_kv_a_mqa",
    "self_attn.kv_a_layernorm": "attn_kv_a_norm",
    "self_attn.kv_b_proj": "attn_kv_b",
    "mlp.shared_experts.gate_proj": "ffn_gate_shexp",
    "mlp.shared_experts.up_proj": "ffn_up_shexp",
    "mlp.shared_experts.down_proj": "ffn_down_shexp",
}
_EXPERT = {"gate_proj": "ffn_gate_exps", "up_proj": "ffn_up_exps", "down_proj": "ffn_down_exps"}


def _metadata(w: GGUFWriter, arch: str, cfg: dict, hf_dir: Path, split: bool) -> None:
    heads = cfg["num_attention_heads"]
    rope = cfg.get("rope_parameters") or {}
    add_widths(w, cfg)
    w.add_rope_freq_base(float(rope.get("rope_theta", 10000.0)))
    w.add_expert_count(cfg["n_routed_experts"])
    w.add_expert_used_count(cfg["num_experts_per_tok"])
    w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    w.add_expert_shared_count(cfg["n_shared_experts"])
    w.add_leading_dense_block_count(cfg["first_k_dense_replace"])
    w.add_expert_weights_scale(cfg["routed_scaling_factor"])
    if cfg.get("norm_topk_prob"):
        w.add_expert_weights_norm(True)
    if cfg.get("n_group"):
        w.add_expert_group_count(cfg["n_group"])
        w.add_expert_group_used_count(cfg["topk_group"])
    if cfg["model_type"] in ("deepseek_v3", "glm4_moe"):  # their sigmoid router
        w.add_uint32(f"{arch}.expert_gating_func", 2)
    if arch == "glm4moe":
        w.add_block_count(cfg["num_hidden_layers"] + cfg["num_nextn_predict_layers"])
        w.add_uint32(f"{arch}.nextn_predict_layers", cfg["num_nextn_predict_layers"])
        w.add_head_count_kv(cfg["num_key_value_heads"])
        w.add_key_length(cfg["head_dim"])
        w.add_value_length(cfg["head_dim"])
        w.add_rope_dimension_count(int(cfg["head_dim"] * rope.get("partial_rotary_factor", 0.5)))
    else:
        w.add_block_count(cfg["num_hidden_layers"])
        lora, r, nope, v = (
            cfg["kv_lora_rank"],
            cfg["qk_rope_head_dim"],
            cfg["qk_nope_head_dim"],
            cfg["v_head_dim"],
        )
        if cfg.get("q_lora_rank"):
            w.add_q_lora_rank(cfg["q_lora_rank"])
        w.add_kv_lora_rank(lora)
        w.add_rope_dimension_count(r)
        if split:  # the converter's MQA view of the absorbed attention
            w.add_head_count_kv(1)
            w.add_key_length(lora + r)
            w.add_value_length(lora)
            w.add_key_length_mla(nope + r)
            w.add_value_length_mla(v)
        else:
            w.add_head_count_kv(heads)
            w.add_key_length(nope + r)
            w.add_value_length(v)
        if rope.get("rope_type") == "yarn":
            w.add_rope_scaling_type(RopeScalingType.YARN)
            w.add_rope_scaling_factor(rope["factor"])
            w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
            w.add_rope_scaling_yarn_log_mul(0.1 * rope["mscale_all_dim"])
    add_tokenizer(w, cfg, hf_dir)


def _add(writer: GGUFWriter, name: str, w: np.ndarray, seed: int, policy: dict) -> np.ndarray:
    kind = name.split(".")[-2]
    fmt = policy.get(kind, "F32") if name.endswith(".weight") and w.ndim >= 2 else "F32"
    data, qtype, back = _store(np.ascontiguousarray(w), fmt, seed)
    writer.add_tensor(name, data, raw_dtype=qtype if qtype not in (T.F32, T.F16) else None)
    return back.reshape(w.shape)


def write_gguf(variant: str, root: Path, split: bool = True) -> tuple[Path, Path]:
    """(the GGUF file, a Hugging Face directory of the same model with its weights as the file decodes them)."""
    family, overrides = BUILDS[variant]
    hf_dir = build_model(family, root / f"{variant}-hf", **overrides)
    return convert(hf_dir, root / f"{variant}{'' if split else '-kv_b'}.gguf", split)


def convert(
    hf_dir: Path, out: Path, split: bool = True, policy: dict | None = None, reference: bool = True
) -> tuple[Path, Path | None]:
    """A DeepSeek-V2/V3 or GLM-4.5 checkpoint as llama.cpp's converter writes it, each weight in policy's format
    (POLICY's by default), and (reference) the checkpoint as the file decodes."""
    cfg = json.loads((hf_dir / "config.json").read_text())
    arch = "glm4moe" if cfg["model_type"] == "glm4_moe" else "deepseek2"
    policy = POLICY if policy is None else policy
    writer = GGUFWriter(str(out), arch)
    _metadata(writer, arch, cfg, hf_dir, split)
    # read a tensor at a time and keep the decoded weights only for a reference: a V2-Lite-shaped checkpoint
    # (bench/mla.py) is several GB
    state = safe_open(str(hf_dir / "model.safetensors"), framework="pt")
    ref: dict[str, torch.Tensor] = {}
    stacks: dict = {}
    for n, name in enumerate(sorted(state.keys())):
        parts = name.split(".")
        if ".experts." in name:  # stacked below
            stacks.setdefault((int(parts[2]), _EXPERT[parts[-2]]), {})[int(parts[-3])] = name
            continue
        w = state.get_tensor(name).float().numpy()
        if name in ("model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"):
            gname = {
                "model.embed_tokens.weight": "token_embd",
                "lm_head.weight": "output",
                "model.norm.weight": "output_norm",
            }[name] + ".weight"
        elif name.endswith("e_score_correction_bias"):
            gname = f"blk.{parts[2]}.exp_probs_b.bias"
        elif name.endswith("kv_b_proj.weight") and split:
            heads, nope = cfg["num_attention_heads"], cfg["qk_nope_head_dim"]
            per_head = w.reshape(heads, -1, w.shape[-1])
            k_b = _add(
                writer, f"blk.{parts[2]}.attn_k_b.weight", per_head[:, :nope].transpose(0, 2, 1), n, policy
            )
            v_b = _add(writer, f"blk.{parts[2]}.attn_v_b.weight", per_head[:, nope:], n + 500, policy)
            if reference:
                ref[name] = torch.from_numpy(
                    np.concatenate([k_b.transpose(0, 2, 1), v_b], axis=1).reshape(w.shape)
                )
            continue
        elif arch == "glm4moe" and name.endswith("post_attention_layernorm.weight"):
            gname = f"blk.{parts[2]}.post_attention_norm.weight"  # gguf-py's glm4moe name for it
        else:
            gname = f"blk.{parts[2]}.{_NAMES['.'.join(parts[3:-1])]}.{parts[-1]}"
        back = _add(writer, gname, w, n, policy)
        if reference:
            ref[name] = torch.from_numpy(back)
    for (layer, kind), experts in sorted(stacks.items()):
        names = [experts[e] for e in sorted(experts)]
        back = _add(
            writer,
            f"blk.{layer}.{kind}.weight",
            np.stack([state.get_tensor(n).float().numpy() for n in names]),
            1000 + layer,
            policy,
        )
        if reference:
            ref.update({n: torch.from_numpy(np.ascontiguousarray(back[e])) for e, n in enumerate(names)})
    if arch == "glm4moe":  # the MTP layer: a layer's tensors and the nextn ones, which llama.cpp keeps unused
        mtp = cfg["num_hidden_layers"]
        writer.add_tensor(f"blk.{mtp}.attn_norm.weight", np.ones(cfg["hidden_size"], dtype=np.float32))
        writer.add_tensor(
            f"blk.{mtp}.nextn.eh_proj.weight", np.zeros((4, cfg["hidden_size"]), dtype=np.float32)
        )
    close(writer)
    return out, write_reference(out, hf_dir, ref) if reference else None
