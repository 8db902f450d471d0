"""A GGUF file's metadata as a ModelConfig, for every layout we run.

Layouts (general.architecture) and the keys they use are llama.cpp's (gguf-py's constants.py):
llama covers Llama 1-3.x, Mistral, TinyLlama, SmolLM and, with expert tensors, Mixtral.
"""

import struct
from pathlib import Path

from backend.gguf_file import GGUFFile
from backend.model_config import ModelConfig, ModelLoadError
from backend.quant.formats import FLOAT_TYPES, FORMATS

# layout -> (architecture without experts, architecture with experts)
LAYOUTS = {"llama": ("LlamaForCausalLM", "MixtralForCausalLM"), "qwen2": ("Qwen2ForCausalLM", None),
           "qwen3": ("Qwen3ForCausalLM", None), "qwen2moe": (None, "Qwen2MoeForCausalLM"),
           "qwen3moe": (None, "Qwen3MoeForCausalLM")}
LAYOUT_HELP = ("llama (Llama 1-3.x, Mistral, TinyLlama, SmolLM; Mixtral with experts), qwen2, qwen3, qwen2moe, "
               "qwen3moe")
# Whether the top-k routing weights are renormalised, where the file does not say (llama.cpp's defaults).
_NORM_TOPK = {"llama": True, "qwen2moe": False, "qwen3moe": True}


def dequantizable(ggml_type: int) -> bool:
    """Types gguf-py can expand to floats (IQ*, TQ*, ...): loaded dequantized, with a log line."""
    from gguf.quants import _type_traits

    return ggml_type in FLOAT_TYPES or any(int(t) == ggml_type for t in _type_traits)


def _check_types(path: Path, reader) -> None:
    bad = sorted({t.tensor_type.name for t in reader.tensors
                  if int(t.tensor_type) not in FORMATS and not dequantizable(int(t.tensor_type))})
    if bad:
        kept = ", ".join([*FLOAT_TYPES.values(), *(f.name for f in FORMATS.values())])
        raise ModelLoadError(f"{path}: GGUF tensor type {', '.join(bad)} is not supported; supported: {kept} "
                             "(kept quantized), and IQ*/TQ* types (dequantized at load)")


def gguf_config(path: Path) -> tuple[ModelConfig, object]:
    try:
        reader = GGUFFile(path)
    except (OSError, ValueError, struct.error) as e:  # truncated, foreign, or of an unknown version
        raise ModelLoadError(f"{path}: not a readable GGUF file ({e})") from None

    def field(key, default=None):
        return reader.fields.get(key, default)

    arch = field("general.architecture")
    if arch not in LAYOUTS:
        raise ModelLoadError(f"{path}: GGUF layout {arch!r} is not supported; supported layouts: {LAYOUT_HELP}")
    tensors = {t.name: t for t in reader.tensors}
    experts = int(field(f"{arch}.expert_count", 0) or 0)
    architecture = LAYOUTS[arch][1 if experts else 0]
    if architecture is None:
        raise ModelLoadError(f"{path}: a {arch} GGUF needs {arch}.expert_count (its experts); the file has none")
    _check_types(path, reader)

    heads = int(field(f"{arch}.attention.head_count"))
    hidden = int(field(f"{arch}.embedding_length"))
    head_dim = int(field(f"{arch}.attention.key_length", hidden // heads))
    rot = field(f"{arch}.rope.dimension_count")
    if rot is not None and int(rot) != head_dim:
        raise ModelLoadError(f"{path}: partial rotary embeddings ({rot} of {head_dim} dimensions) are not supported")
    embed = tensors.get("token_embd.weight")
    if embed is None:
        raise ModelLoadError(f"{path}: no token_embd.weight tensor; is this a complete {arch} GGUF?")
    eos = [field(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    mc = ModelConfig(
        architecture=architecture, vocab_size=int(embed.shape[1]), hidden_size=hidden,
        intermediate_size=int(field(f"{arch}.feed_forward_length", 0) or 0),
        num_layers=int(field(f"{arch}.block_count")), num_heads=heads,
        num_kv_heads=int(field(f"{arch}.attention.head_count_kv", heads)), head_dim=head_dim,
        rms_norm_eps=float(field(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(field(f"{arch}.rope.freq_base", 10000.0)), rope_scaling=_rope_scaling(path, arch, field, tensors),
        max_position_embeddings=int(field(f"{arch}.context_length", 4096)),
        tie_word_embeddings="output.weight" not in tensors, eos_token_ids=sorted({int(e) for e in eos if e is not None}),
        qkv_bias="blk.0.attn_q.bias" in tensors, o_bias="blk.0.attn_output.bias" in tensors,
        qk_norm="blk.0.attn_q_norm.weight" in tensors)
    if experts:
        mc.num_experts = experts
        mc.num_experts_per_tok = int(field(f"{arch}.expert_used_count"))
        mc.moe_intermediate_size = int(field(f"{arch}.expert_feed_forward_length", 0) or mc.intermediate_size)
        mc.norm_topk_prob = bool(field(f"{arch}.expert_weights_norm", _NORM_TOPK[arch]))
        mc.mlp_only_layers = [i for i in range(mc.num_layers) if f"blk.{i}.ffn_gate_inp.weight" not in tensors]
        shared = tensors.get("blk.0.ffn_up_shexp.weight") or next(
            (t for n, t in tensors.items() if n.endswith("ffn_up_shexp.weight")), None)
        if shared is not None:
            mc.shared_expert_intermediate_size = int(field(f"{arch}.expert_shared_feed_forward_length", 0)
                                                     or shared.shape[1])
    return mc, reader


def _rope_scaling(path: Path, arch: str, field, tensors) -> dict | None:
    import numpy as np

    if "rope_freqs.weight" in tensors:
        # Llama 3.1+: the converter stores each frequency's divisor (llama3 scaling, already evaluated).
        factors = np.asarray(tensors["rope_freqs.weight"].data, dtype=np.float32).reshape(-1)
        return {"rope_type": "factors", "factors": factors.tolist()}
    kind = field(f"{arch}.rope.scaling.type", "none")
    if kind in ("none", None):
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(field(f"{arch}.rope.scaling.factor"))}
    if kind == "yarn":
        if field(f"{arch}.rope.scaling.factor") is None:
            raise ModelLoadError(f"{path}: GGUF rope scaling 'yarn' without {arch}.rope.scaling.factor")
        scaling = {"rope_type": "yarn", "factor": float(field(f"{arch}.rope.scaling.factor")),
                   "original_max_position_embeddings": int(field(f"{arch}.rope.scaling.original_context_length")
                                                           or field(f"{arch}.context_length", 4096))}
        for key, name in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow")):
            if field(f"{arch}.rope.scaling.{key}") is not None:
                scaling[name] = float(field(f"{arch}.rope.scaling.{key}"))
        return scaling
    raise ModelLoadError(f"{path}: GGUF rope scaling {kind!r} is not supported; supported: none, linear, yarn, "
                         "and Llama 3's frequency factors (rope_freqs)")
