"""Tiny qwen3next and qwen35moe GGUF files, written with gguf.GGUFWriter as llama.cpp's convert_hf_to_gguf.py lays
them out (Qwen3NextModel, Qwen3_5MoeTextModel; names and keys from gguf-py's constants): q|k|v and z as attn_qkv
and attn_gate (or, as older qwen3next files hold it, the checkpoint's grouped in_proj_qkvz as ssm_in), b|a grouped
by key head as ssm_ba (qwen3next) or apart as ssm_beta and ssm_alpha (qwen35moe), -exp(A_log) as ssm_a, dt_bias as
ssm_dt.bias, the convolution squeezed, (1 + w) norms as 1 + w except ssm_norm, and for qwen35moe every value-head
tensor in the converter's tiled order. The reference is the same Hugging Face model with the file's weights as they
decode, taken back through each of those steps."""

import json
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType as T
from gguf import GGUFWriter
from safetensors.torch import load_file

from tests.backend.tiny_gguf import _store
from tests.backend.tiny_gguf_parts import add_tokenizer, add_widths, close, write_reference
from tests.backend.tiny_models import build_model

# layout -> (family of tiny_models.py, its overrides); llama.cpp's qwen3next has no dense layers
BUILDS = {"qwen3next": ("qwen3_next", dict(mlp_only_layers=[])), "qwen35moe": ("qwen3_5_moe", {})}
# Widths that hold whole 256-blocks where K-quants are asked for (else _store falls back to Q8_0, 32-blocks); the
# value heads (8 wide) stay narrower than a block, so that no loader could undo the tiled columns of ssm_out
QUANT_SHAPES = dict(hidden_size=256, shared_expert_intermediate_size=64)
QUANT_POLICY = {
    "token_embd": "Q8_0",
    "output": "Q6_K",
    "attn_q": "Q4_K",
    "attn_k": "Q4_K",
    "attn_v": "Q6_K",
    "attn_output": "Q8_0",
    "attn_qkv": "Q4_K",
    "attn_gate": "Q5_K",
    "ssm_in": "Q4_K",
    "ssm_ba": "Q8_0",
    "ssm_beta": "Q8_0",
    "ssm_alpha": "Q8_0",
    "ssm_out": "Q8_0",
    "ffn_gate_exps": "Q4_K",
    "ffn_up_exps": "Q4_K",
    "ffn_down_exps": "Q8_0",
    "ffn_gate_shexp": "Q4_K",
    "ffn_up_shexp": "Q4_K",
    "ffn_down_shexp": "Q8_0",
}
_NAMES = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "post_attention_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "linear_attn.norm": "ssm_norm",
    "mlp.gate": "ffn_gate_inp",
    "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
    "mlp.shared_expert.up_proj": "ffn_up_shexp",
    "mlp.shared_expert.down_proj": "ffn_down_shexp",
    "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
}
_EXPERT = {"gate_proj": "ffn_gate_exps", "up_proj": "ffn_up_exps", "down_proj": "ffn_down_exps"}


def _tile(x: np.ndarray, axis: int, key_heads: int, per: int, width: int, back: bool = False) -> np.ndarray:
    """The converter's _reorder_v_heads along axis: value heads grouped by key head -> tiled (back: the inverse)."""
    x = np.moveaxis(x, axis, 0)
    lead = (per, key_heads) if back else (key_heads, per)
    out = x.reshape(*lead, width, *x.shape[1:]).swapaxes(0, 1).reshape(x.shape)
    return np.ascontiguousarray(np.moveaxis(out, 0, axis))


def _metadata(w: GGUFWriter, arch: str, cfg: dict, hf_dir: Path) -> None:
    # the MoE configs of Qwen3.5 name no dense width: the experts' stands in (llama.cpp reads it only as a fallback)
    add_widths(w, {**cfg, "intermediate_size": cfg.get("intermediate_size") or cfg["moe_intermediate_size"]})
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_key_length(cfg["head_dim"])
    w.add_value_length(cfg["head_dim"])
    rope = cfg.get("rope_parameters") or {}
    w.add_rope_freq_base(float(rope.get("rope_theta", 10000.0)))
    w.add_rope_dimension_count(int(cfg["head_dim"] * rope.get("partial_rotary_factor", 0.25)))
    if (
        arch == "qwen35moe"
    ):  # its interleaved MRoPE's sections, the converter's default (one position for text)
        sections = list(rope.get("mrope_section", [11, 11, 10]))
        w.add_rope_dimension_sections(sections + [0] * (4 - len(sections)))
    w.add_expert_count(cfg["num_experts"])
    w.add_expert_used_count(cfg["num_experts_per_tok"])
    w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    w.add_expert_shared_feed_forward_length(cfg["shared_expert_intermediate_size"])
    w.add_ssm_conv_kernel(cfg["linear_conv_kernel_dim"])
    w.add_ssm_state_size(cfg["linear_key_head_dim"])
    w.add_ssm_group_count(cfg["linear_num_key_heads"])
    w.add_ssm_time_step_rank(cfg["linear_num_value_heads"])
    w.add_ssm_inner_size(cfg["linear_value_head_dim"] * cfg["linear_num_value_heads"])
    w.add_full_attention_interval(cfg.get("full_attention_interval") or 4)
    add_tokenizer(w, cfg, hf_dir)


class _Writer:
    """Adds tensors in their policy's format and keeps each one's decoded weights (the file's order)."""

    def __init__(self, writer: GGUFWriter, policy: dict):
        self.writer, self.policy, self.n = writer, policy, 0

    def add(self, name: str, w: np.ndarray) -> np.ndarray:
        kind = name.split(".")[2] if name.startswith("blk.") else name.split(".")[0]
        fmt = self.policy.get(kind, "F32") if w.ndim >= 2 and name.endswith(".weight") else "F32"
        self.n += 1
        data, qtype, back = _store(np.ascontiguousarray(w, dtype=np.float32), fmt, self.n)
        self.writer.add_tensor(name, data, raw_dtype=qtype if qtype not in (T.F32, T.F16) else None)
        return back.reshape(w.shape)


def _linear(out: _Writer, arch: str, cfg: dict, bid: int, attr: str, w: np.ndarray, legacy: bool) -> dict:
    """One linear-attention tensor as the converter writes it; returns the reference's tensors it decodes to."""
    kh, vh, dk, dv = (
        cfg[f"linear_{n}"] for n in ("num_key_heads", "num_value_heads", "key_head_dim", "value_head_dim")
    )
    per, keys, blk = vh // kh, 2 * kh * dk, f"blk.{bid}"
    hf = f"model.layers.{bid}.linear_attn.{attr}"
    tiled = arch == "qwen35moe" and per > 1

    def tile(x, axis, width, back=False):
        return _tile(x, axis, kh, per, width, back) if tiled else x

    if attr == "in_proj_qkvz.weight" and legacy:
        return {hf: out.add(f"{blk}.ssm_in.weight", w)}
    if attr == "in_proj_qkvz.weight":  # grouped [q, k, v, z] a key head -> q|k|v and z
        q, k, v, z = np.split(w.reshape(kh, -1, w.shape[-1]), np.cumsum([dk, dk, per * dv]), axis=1)
        qkv = out.add(
            f"{blk}.attn_qkv.weight", np.concatenate([x.reshape(-1, w.shape[-1]) for x in (q, k, v)])
        )
        z = out.add(f"{blk}.attn_gate.weight", z.reshape(-1, w.shape[-1]))
        q, k, v = np.split(qkv, [kh * dk, keys])
        parts = [x.reshape(kh, -1, w.shape[-1]) for x in (q, k, v, z)]
        return {hf: np.concatenate(parts, axis=1).reshape(w.shape)}
    if attr == "in_proj_qkv.weight":
        back = out.add(f"{blk}.attn_qkv.weight", np.concatenate([w[:keys], tile(w[keys:], 0, dv)]))
        return {hf: np.concatenate([back[:keys], tile(back[keys:], 0, dv, back=True)])}
    simple = {
        "in_proj_z.weight": ("attn_gate.weight", 0, dv),
        "in_proj_b.weight": ("ssm_beta.weight", 0, 1),
        "in_proj_a.weight": ("ssm_alpha.weight", 0, 1),
        "out_proj.weight": ("ssm_out.weight", 1, dv),
        "in_proj_ba.weight": ("ssm_ba.weight", 0, 1),
        "dt_bias": ("ssm_dt.bias", 0, 1),
    }
    if attr in simple:
        name, axis, width = simple[attr]
        return {hf: tile(out.add(f"{blk}.{name}", tile(w, axis, width)), axis, width, back=True)}
    if attr == "A_log":
        return {hf: np.log(-tile(out.add(f"{blk}.ssm_a", tile(-np.exp(w), 0, 1)), 0, 1, back=True))}
    if attr == "conv1d.weight":  # [channels, 1, kernel] squeezed; tiled, only the value channels move
        squeezed = w[:, 0]
        back = out.add(
            f"{blk}.ssm_conv1d.weight", np.concatenate([squeezed[:keys], tile(squeezed[keys:], 0, dv)])
        )
        return {hf: np.concatenate([back[:keys], tile(back[keys:], 0, dv, back=True)])[:, None]}
    raise AssertionError(f"no GGUF rule for {hf}")


def convert(
    hf_dir: Path, out_path: Path, policy: dict | None = None, legacy: bool = False, reference: bool = True
) -> tuple[Path, Path | None]:
    """A Qwen3-Next or Qwen3.5-MoE checkpoint as llama.cpp's converter writes it, each weight in policy's format
    (F32 where not named), and (reference) the checkpoint as the file decodes. legacy: qwen3next's older ssm_in."""
    cfg = json.loads((hf_dir / "config.json").read_text())
    arch = "qwen3next" if cfg["model_type"] == "qwen3_next" else "qwen35moe"
    writer = GGUFWriter(str(out_path), arch)
    _metadata(writer, arch, cfg, hf_dir)
    out, state, ref, stacks = (
        _Writer(writer, policy or {}),
        load_file(str(hf_dir / "model.safetensors")),
        {},
        {},
    )
    globals_ = {
        "model.embed_tokens.weight": "token_embd",
        "lm_head.weight": "output",
        "model.norm.weight": "output_norm",
    }
    for name, tensor in sorted(state.items()):
        w, parts = tensor.float().numpy(), name.split(".")
        if name in globals_:
            unit = float(name == "model.norm.weight")  # the converter's 1 + w
            ref[name] = out.add(f"{globals_[name]}.weight", w + unit) - unit
        elif ".experts." in name:
            stacks.setdefault((int(parts[2]), _EXPERT[parts[-2]]), {})[int(parts[-3])] = name
        elif parts[3] == "linear_attn" and parts[4] != "norm":
            ref.update(_linear(out, arch, cfg, int(parts[2]), ".".join(parts[4:]), w, legacy))
        else:
            kind = _NAMES[".".join(parts[3:-1])]
            unit = float(kind.endswith("norm") and kind != "ssm_norm")
            ref[name] = out.add(f"blk.{parts[2]}.{kind}.{parts[-1]}", w + unit) - unit
    for (layer, kind), experts in sorted(stacks.items()):
        names = [experts[e] for e in sorted(experts)]
        back = out.add(f"blk.{layer}.{kind}.weight", np.stack([state[n].float().numpy() for n in names]))
        ref.update({n: np.ascontiguousarray(back[e]) for e, n in enumerate(names)})
    close(writer)
    tensors = {k: torch.from_numpy(np.ascontiguousarray(v, dtype=np.float32)) for k, v in ref.items()}
    return out_path, write_reference(out_path, hf_dir, tensors) if reference else None


def write_gguf(arch: str, root: Path, quantized: bool = False, legacy: bool = False) -> tuple[Path, Path]:
    """(the GGUF file, a Hugging Face directory of the same model with its weights as the file decodes them)."""
    family, overrides = BUILDS[arch]
    label = f"{arch}{'-q' if quantized else ''}{'-ssm_in' if legacy else ''}"
    hf_dir = build_model(family, root / f"{label}-hf", **overrides, **(QUANT_SHAPES if quantized else {}))
    return convert(hf_dir, root / f"{label}.gguf", QUANT_POLICY if quantized else None, legacy)
