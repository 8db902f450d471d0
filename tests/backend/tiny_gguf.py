"""Tiny GGUF files of every layout, written with gguf.GGUFWriter as llama.cpp's convert_hf_to_gguf.py lays
them out (tensor names and metadata keys from gguf-py's constants), from the tiny checkpoints of tiny_models.py.

Each 2-D (or expert 3-D) weight is stored in the format a per-family policy names: the 32-blocks through
gguf-py's quantizer, K-quants and TQ2_0 from random blocks. The reference is the same Hugging Face class
with the file's weights dequantized back (reference_dir), so both sides compute on identical numbers.
"""

import json
import math
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType as T
from gguf import GGUFWriter, RopeScalingType
from gguf.quants import dequantize, quantize
from safetensors.torch import load_file

from backend.quant.formats import BY_NAME
from tests.backend.quant_blocks import GGUF_QUANTIZES, random_raw
from tests.backend.tiny_gguf_parts import add_tokenizer, add_widths, close, write_reference
from tests.backend.tiny_models import build_model

# Shapes every format can hold: rows of whole 256-blocks (K-quants).
SHAPES = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2)
MOE_SHAPES = dict(moe_intermediate_size=256, shared_expert_intermediate_size=256)
LAYOUT = {"llama": "llama", "llama3_rope_tied": "llama", "mistral": "llama", "mixtral": "llama", "qwen2": "qwen2",
          "qwen3": "qwen3", "qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe", "smollm3": "smollm3", "phi3": "phi3",
          "phi4_partial_rotary": "phi3", "olmoe": "olmoe", "granitemoe": "granitemoe",
          "granitemoe_shared": "granitemoe"}
# family -> {GGUF tensor kind: format}; kinds not named are F32 (norms, biases, routers)
POLICY = {
    "llama": {"token_embd": "Q8_0", "output": "Q6_K", "attn_q": "Q4_0", "attn_k": "Q4_0", "attn_v": "Q8_0",
              "attn_output": "Q4_1", "ffn_gate": "Q4_1", "ffn_up": "Q4_1", "ffn_down": "Q5_0"},
    "llama3_rope_tied": {"token_embd": "Q8_0", "attn_q": "Q4_K", "attn_k": "Q4_K", "attn_v": "Q6_K",
                         "attn_output": "Q4_K", "ffn_gate": "Q4_K", "ffn_up": "Q4_K", "ffn_down": "Q6_K"},
    "mistral": {"token_embd": "F16", "output": "Q8_0", "attn_q": "Q5_1", "attn_k": "Q5_1", "attn_v": "Q5_1",
                "attn_output": "Q5_0", "ffn_gate": "Q5_0", "ffn_up": "Q5_1", "ffn_down": "TQ2_0"},
    "qwen2": {"token_embd": "Q4_K", "output": "Q5_K", "attn_q": "Q5_K", "attn_k": "Q5_K", "attn_v": "Q6_K",
              "attn_output": "Q5_K", "ffn_gate": "Q2_K", "ffn_up": "Q2_K", "ffn_down": "Q3_K"},
    "qwen3": {"token_embd": "Q6_K", "output": "Q8_0", "attn_q": "Q3_K", "attn_k": "Q3_K", "attn_v": "Q2_K",
              "attn_output": "Q4_1", "ffn_gate": "Q4_K", "ffn_up": "Q5_K", "ffn_down": "Q6_K"},
    "mixtral": {"token_embd": "Q4_K", "output": "Q6_K", "attn_q": "Q4_K", "attn_k": "Q4_K", "attn_v": "Q6_K",
                "attn_output": "Q4_K", "ffn_gate_exps": "Q4_K", "ffn_up_exps": "Q4_K", "ffn_down_exps": "Q6_K"},
    "qwen2_moe": {"token_embd": "Q8_0", "output": "Q8_0", "attn_q": "Q8_0", "attn_k": "Q8_0", "attn_v": "Q8_0",
                  "attn_output": "Q8_0", "ffn_gate": "Q4_0", "ffn_up": "Q4_0", "ffn_down": "Q4_0",
                  "ffn_gate_exps": "Q8_0", "ffn_up_exps": "Q5_0", "ffn_down_exps": "Q4_1",
                  "ffn_gate_shexp": "Q4_0", "ffn_up_shexp": "Q4_0", "ffn_down_shexp": "Q5_1"},
    "qwen3_moe": {"token_embd": "Q5_K", "output": "Q4_K", "attn_q": "Q4_K", "attn_k": "Q4_K", "attn_v": "Q5_K",
                  "attn_output": "Q4_K", "ffn_gate_exps": "Q4_K", "ffn_up_exps": "Q5_K", "ffn_down_exps": "Q6_K"},
    "smollm3": {"token_embd": "Q8_0", "attn_q": "Q4_K", "attn_k": "Q4_K", "attn_v": "Q8_0", "attn_output": "Q4_0",
                "ffn_gate": "Q5_K", "ffn_up": "Q5_K", "ffn_down": "Q6_K"},
    "phi3": {"token_embd": "Q8_0", "output": "Q6_K", "attn_qkv": "Q4_K", "attn_output": "Q5_0", "ffn_up": "Q4_K",
             "ffn_down": "Q6_K"},
    "phi4_partial_rotary": {"token_embd": "Q8_0", "attn_qkv": "Q5_K", "attn_output": "Q4_K", "ffn_up": "Q4_1",
                            "ffn_down": "Q8_0"},
    "olmoe": {"token_embd": "Q8_0", "output": "Q6_K", "attn_q": "Q4_K", "attn_k": "Q4_K", "attn_v": "Q8_0",
              "attn_output": "Q5_0", "ffn_gate_exps": "Q4_K", "ffn_up_exps": "Q4_K", "ffn_down_exps": "Q6_K"},
    "granitemoe": {"token_embd": "Q6_K", "output": "Q8_0", "attn_q": "Q5_K", "attn_k": "Q5_K", "attn_v": "Q6_K",
                   "attn_output": "Q4_K", "ffn_gate_exps": "Q8_0", "ffn_up_exps": "Q5_K", "ffn_down_exps": "Q4_K"},
    "granitemoe_shared": {"token_embd": "Q8_0", "output": "Q6_K", "attn_q": "Q4_K", "attn_k": "Q4_K",
                          "attn_v": "Q8_0", "attn_output": "Q4_K", "ffn_gate_exps": "Q4_K", "ffn_up_exps": "Q4_K",
                          "ffn_down_exps": "Q6_K", "ffn_gate_shexp": "Q5_K", "ffn_up_shexp": "Q5_K",
                          "ffn_down_shexp": "Q8_0"},
}
# layouts whose q/k rows convert_hf_to_gguf.py interleaves (LlamaModel.permute; GraniteMoeModel inherits it)
PERMUTED = ("llama", "smollm3", "granitemoe")
# a decoder layer's module -> llama.cpp's tensor kind, for what every layout names alike
LAYER_NAMES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
               "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
               "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate",
               "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down", "mlp.gate": "ffn_gate_inp"}
_NAMES = {**LAYER_NAMES, "block_sparse_moe.gate": "ffn_gate_inp", "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
          "mlp.shared_expert.up_proj": "ffn_up_shexp", "mlp.shared_expert.down_proj": "ffn_down_shexp",
          "mlp.shared_expert_gate": "ffn_gate_inp_shexp", "self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up"}
# Granite-MoE's tensors -> llama.cpp's (GraniteMoeModel.modify_tensors splits the fused gate | up in two halves)
_GRANITE = {"block_sparse_moe.input_linear": ("ffn_gate_exps", "ffn_up_exps"),
            "block_sparse_moe.output_linear": ("ffn_down_exps",), "block_sparse_moe.router.layer": ("ffn_gate_inp",),
            "shared_mlp.input_linear": ("ffn_gate_shexp", "ffn_up_shexp"), "shared_mlp.output_linear": ("ffn_down_shexp",)}
_EXPERT = {"w1": "ffn_gate_exps", "w3": "ffn_up_exps", "w2": "ffn_down_exps", "gate_proj": "ffn_gate_exps",
           "up_proj": "ffn_up_exps", "down_proj": "ffn_down_exps"}


def build_family(name: str, directory: Path, **extra) -> Path:
    shapes = dict(SHAPES, **(MOE_SHAPES if name in ("qwen2_moe", "qwen3_moe") else {}))
    if name == "granitemoe_shared":
        shapes["shared_intermediate_size"] = 256
    if name == "mistral":
        extra.setdefault("sliding_window", None)  # llama.cpp's llama layout has no window
    if name == "mixtral":
        shapes["intermediate_size"] = 256
    return build_model(name, directory, **{**shapes, **extra})


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute: rotary pairs interleaved per head."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _store(w: np.ndarray, fmt: str, seed: int) -> tuple[np.ndarray, T, np.ndarray]:
    """(what to write, its type, the weights it decodes to). As llama.cpp's quantizer does, a row that
    does not hold whole blocks of the format falls back to Q8_0."""
    if fmt not in ("F32", "F16") and w.shape[-1] % BY_NAME.get(fmt, BY_NAME["Q4_K"]).block:
        fmt = "Q8_0"
    if fmt in ("F32", "F16"):
        data = w.astype(np.float32 if fmt == "F32" else np.float16)
        return data, getattr(T, fmt), data.astype(np.float32)
    qtype = getattr(T, fmt)
    if fmt in GGUF_QUANTIZES or fmt == "TQ2_0":
        raw = quantize(w.astype(np.float32), qtype)
    else:
        raw = random_raw(fmt, w.shape[-2], w.shape[-1], seed, lead=w.shape[:-2])
    return raw, qtype, dequantize(raw, qtype).reshape(w.shape).astype(np.float32)


def _rope_factors(cfg: dict) -> np.ndarray:
    """The llama3 rope divisors as convert_hf_to_gguf.py computes them (rope_freqs)."""
    s = cfg.get("rope_scaling") or cfg.get("rope_parameters")
    dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    theta = cfg.get("rope_theta") or s.get("rope_theta")
    freqs = 1.0 / (theta ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    old, low, high, factor = (s["original_max_position_embeddings"], s["low_freq_factor"], s["high_freq_factor"],
                              s["factor"])
    out = []
    for f in freqs:
        wavelen = 2 * math.pi / f
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def _metadata(w: GGUFWriter, arch: str, cfg: dict, hf_dir: Path) -> None:
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    w.add_name("tiny")
    add_widths(w, cfg)
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    rotary = (cfg.get("rope_parameters") or {}).get("partial_rotary_factor") or 1.0
    w.add_rope_dimension_count(int(rotary * head_dim))
    if arch == "phi3":
        w.add_sliding_window(cfg.get("sliding_window") or 0)  # 0: none (Phi-4)
        trained = (cfg.get("rope_parameters") or {}).get("original_max_position_embeddings") or cfg.get(
            "original_max_position_embeddings", cfg["max_position_embeddings"])
        w.add_rope_scaling_orig_ctx_len(trained)
        if (cfg.get("rope_parameters") or {}).get("long_factor"):  # LongRoPE: the converter's attention factor
            scale = cfg["max_position_embeddings"] / trained
            w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(trained)) if scale > 1 else 1.0)
    w.add_rope_freq_base(float(cfg.get("rope_theta") or (cfg.get("rope_parameters") or {}).get("rope_theta")))
    rope = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    if (rope.get("rope_type") or rope.get("type")) == "yarn":  # the keys convert_hf_to_gguf.py writes
        w.add_rope_scaling_type(RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    experts = cfg.get("num_local_experts") or cfg.get("num_experts")
    if experts:
        w.add_expert_count(experts)
        w.add_expert_used_count(cfg["num_experts_per_tok"])
        if arch in ("qwen2moe", "qwen3moe"):
            w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
        if cfg.get("shared_expert_intermediate_size") or cfg.get("shared_intermediate_size"):
            w.add_expert_shared_feed_forward_length(cfg.get("shared_expert_intermediate_size")
                                                    or cfg["shared_intermediate_size"])
    if arch == "granitemoe":  # GraniteModel.set_gguf_parameters' names for the multipliers
        w.add_attention_scale(cfg["attention_multiplier"])
        w.add_embedding_scale(cfg["embedding_multiplier"])
        w.add_residual_scale(cfg["residual_multiplier"])
        w.add_logit_scale(cfg["logits_scaling"])
    add_tokenizer(w, cfg, hf_dir)
    w.add_pad_token_id(cfg["pad_token_id"])


def write_gguf(family: str, hf_dir: Path, out: Path, policy: dict | None = None, legacy_experts: bool = False,
               seed: int = 0) -> tuple[Path, Path]:
    """(the GGUF file, a Hugging Face directory of the same model with its weights as the file decodes them)."""
    cfg = json.loads((hf_dir / "config.json").read_text())
    arch = LAYOUT[family]
    policy = POLICY[family] if policy is None else policy
    state = load_file(str(hf_dir / "model.safetensors"))
    ref: dict[str, torch.Tensor] = {}
    writer = GGUFWriter(str(out), arch)
    _metadata(writer, arch, cfg, hf_dir)
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    stacks: dict[tuple[int, str], dict[int, str]] = {}
    for n, (name, tensor) in enumerate(sorted(state.items())):
        parts = name.split(".")
        if name.startswith("model.layers.") and ".experts." in name:
            layer, expert, proj = int(parts[2]), int(parts[parts.index("experts") + 1]), parts[-2]
            stacks.setdefault((layer, _EXPERT[proj]), {})[expert] = name
            continue
        if name == "model.embed_tokens.weight":
            gname = "token_embd.weight"
        elif name == "lm_head.weight":
            if cfg.get("tie_word_embeddings"):
                continue
            gname = "output.weight"
        elif name == "model.norm.weight":
            gname = "output_norm.weight"
        else:
            layer, module, suffix = parts[2], ".".join(parts[3:-1]), parts[-1]
            if module in _GRANITE:
                ref[name] = _write_split(writer, tensor, layer, _GRANITE[module], policy, seed + n)
                continue
            gname = f"blk.{layer}.{_NAMES[module]}.{suffix}"
        kind = gname.split(".")[-2]
        w = tensor.float().numpy()
        permute = arch in PERMUTED and kind in ("attn_q", "attn_k")
        if permute:
            w = _permute(w, heads if kind == "attn_q" else kv_heads)
        fmt = policy.get(kind, "F32") if suffix_is_weight(gname) and w.ndim == 2 else "F32"
        if kind == "ffn_gate_inp_shexp":
            w = w.reshape(-1)  # llama.cpp keeps the shared expert's gate as a vector
        data, qtype, back = _store(w, fmt, seed + n)
        writer.add_tensor(gname, data, raw_dtype=qtype if fmt not in ("F32", "F16") else None)
        back = back.reshape(tensor.shape) if kind == "ffn_gate_inp_shexp" else back
        ref[name] = torch.from_numpy(_unpermute(back, heads if kind == "attn_q" else kv_heads) if permute else back)
    for (layer, kind), experts in sorted(stacks.items()):
        names = [experts[e] for e in sorted(experts)]
        w = np.stack([state[n].float().numpy() for n in names])
        fmt = policy.get(kind, "F32")
        if legacy_experts:  # older Mixtral files: blk.N.ffn_gate.E.weight, one tensor per expert
            for e, n in enumerate(names):
                data, qtype, back = _store(w[e], fmt, seed + 1000 + layer * 100 + e)
                writer.add_tensor(f"blk.{layer}.{kind[:-5]}.{e}.weight", data,
                                  raw_dtype=qtype if fmt not in ("F32", "F16") else None)
                ref[n] = torch.from_numpy(back)
        else:
            data, qtype, back = _store(w, fmt, seed + 1000 + layer)
            writer.add_tensor(f"blk.{layer}.{kind}.weight", data, raw_dtype=qtype if fmt not in ("F32", "F16") else None)
            for e, n in enumerate(names):
                ref[n] = torch.from_numpy(np.ascontiguousarray(back[e]))
    rope = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    if rope.get("rope_type") == "llama3":
        writer.add_tensor("rope_freqs.weight", _rope_factors(cfg))
    if rope.get("rope_type") == "longrope":
        for kind in ("long", "short"):
            writer.add_tensor(f"rope_factors_{kind}.weight", np.array(rope[f"{kind}_factor"], dtype=np.float32))
    close(writer)
    return out, write_reference(out, hf_dir, ref)


def _write_split(writer: GGUFWriter, tensor: torch.Tensor, layer: str, kinds: tuple, policy: dict,
                 seed: int) -> torch.Tensor:
    """A fused tensor written as llama.cpp's parts (its rows split evenly); returns what the parts decode to,
    fused again."""
    backs = []
    for i, (kind, w) in enumerate(zip(kinds, np.split(tensor.float().numpy(), len(kinds), axis=-2))):
        fmt = policy.get(kind, "F32")
        data, qtype, back = _store(np.ascontiguousarray(w), fmt, seed * 7 + i)
        writer.add_tensor(f"blk.{layer}.{kind}.weight", data, raw_dtype=qtype if fmt not in ("F32", "F16") else None)
        backs.append(back.reshape(w.shape))
    return torch.from_numpy(np.ascontiguousarray(np.concatenate(backs, axis=-2)))


def suffix_is_weight(gname: str) -> bool:
    return gname.endswith(".weight")
