"""A GGUF file's metadata as a ModelConfig, for every layout we run.

Layouts (general.architecture) and the keys they use are llama.cpp's (gguf-py's constants.py):
llama covers Llama 1-3.x, Mistral, TinyLlama, SmolLM and, with expert tensors, Mixtral; smollm3 is llama's
tensors with every fourth layer NoPE (no key says so: llama.cpp hard-codes the step); phi3 (Phi-3, Phi-4) fuses
q|k|v into attn_qkv and gate|up into ffn_up; olmoe norms all of q and of k (attn_q_norm as wide as q); granitemoe
is llama's tensors (q/k permuted) with Granite's four multipliers as keys.
"""

import math
import struct
from pathlib import Path

from backend.families import deepseek, gemma3, gpt_oss, qwen3_next
from backend.gguf_file import GGUFFile
from backend.layer_spec import DENSE, MOE_SOFTMAX_TOPK, LayerSpec, attention_of
from backend.model_config import ModelConfig, ModelLoadError
from backend.quant.formats import FLOAT_TYPES, FORMATS

# layout -> (architecture without experts, architecture with experts)
LAYOUTS = {"llama": ("LlamaForCausalLM", "MixtralForCausalLM"), "qwen2": ("Qwen2ForCausalLM", None),
           "qwen3": ("Qwen3ForCausalLM", None), "qwen2moe": (None, "Qwen2MoeForCausalLM"),
           "qwen3moe": (None, "Qwen3MoeForCausalLM"), "smollm3": ("SmolLM3ForCausalLM", None),
           "phi3": ("Phi3ForCausalLM", None), "olmoe": (None, "OlmoeForCausalLM"),
           "granitemoe": (None, "GraniteMoeForCausalLM"), "deepseek2": ("DeepseekV2ForCausalLM", "DeepseekV2ForCausalLM"),
           "glm4moe": (None, "Glm4MoeForCausalLM"), "gemma3": ("Gemma3ForCausalLM", None),
           "gpt-oss": (None, "GptOssForCausalLM"), "qwen3next": (None, "Qwen3NextForCausalLM"),
           "qwen35moe": (None, "Qwen3_5MoeForCausalLM")}
LAYOUT_HELP = ("llama (Llama 1-3.x, Mistral, TinyLlama, SmolLM; Mixtral with experts), qwen2, qwen3, qwen2moe, "
               "qwen3moe, smollm3, phi3 (Phi-3, Phi-4), olmoe, granitemoe (Granite-MoE, with or without its shared "
               "expert), deepseek2 (DeepSeek-V2/V3, both kv_b layouts), glm4moe (GLM-4.5), gemma3 (Gemma 3, text), gpt-oss, "
               "qwen3next (Qwen3-Next), qwen35moe (Qwen3.5-MoE, text)")
# layouts whose q/k rows llama.cpp's converter interleaves for its rotary
ROPE_PERMUTED = ("llama", "smollm3", "granitemoe")
_NO_ROPE_STEP = {"smollm3": 4}  # llama.cpp's n_no_rope_layer_step: layer i is NoPE where (i + 1) % step == 0
_WINDOWED = ("phi3",)  # layouts whose sliding_window key llama.cpp reads (its llama layout ignores Mistral's)
# Whether the top-k routing weights are renormalised, where the file does not say (llama.cpp's defaults).
_NORM_TOPK = {"gpt-oss": True, "llama": True, "qwen2moe": False, "qwen3moe": True, "olmoe": False, "granitemoe": True,
              "deepseek2": False, "glm4moe": False, "qwen3next": True, "qwen35moe": True}


def dequantizable(ggml_type: int) -> bool:
    """Types gguf-py can expand to floats that no kernel of ours reads (NVFP4, ...): loaded dequantized, with a log
    line."""
    from gguf.quants import _type_traits

    return ggml_type in FLOAT_TYPES or any(int(t) == ggml_type for t in _type_traits)


def _check_types(path: Path, reader) -> None:
    bad = sorted({t.tensor_type.name for t in reader.tensors
                  if int(t.tensor_type) not in FORMATS and not dequantizable(int(t.tensor_type))})
    if bad:
        kept = ", ".join(f.name for f in FORMATS.values())
        raise ModelLoadError(f"{path}: GGUF tensor type {', '.join(bad)} is not supported; supported: "
                             f"{', '.join(FLOAT_TYPES.values())} (floats), {kept} (kept quantized), and the other "
                             "types gguf-py reads (dequantized at load)")


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
    rot = int(field(f"{arch}.rope.dimension_count", head_dim))
    if rot != head_dim and arch in ROPE_PERMUTED:
        raise ModelLoadError(f"{path}: partial rotary embeddings ({rot} of {head_dim} dimensions) are not supported "
                             f"in the {arch} layout")
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
        max_position_embeddings=int(field(f"{arch}.context_length", 4096)), rotary_dim=rot,
        tie_word_embeddings="output.weight" not in tensors, eos_token_ids=sorted({int(e) for e in eos if e is not None}),
        qkv_bias="blk.0.attn_q.bias" in tensors or "blk.0.attn_qkv.bias" in tensors,
        o_bias="blk.0.attn_output.bias" in tensors)
    if experts:
        mc.num_experts = experts
        mc.num_experts_per_tok = int(field(f"{arch}.expert_used_count"))
        mc.moe_intermediate_size = int(field(f"{arch}.expert_feed_forward_length", 0) or mc.intermediate_size)
        mc.norm_topk_prob = bool(field(f"{arch}.expert_weights_norm", _NORM_TOPK[arch]))
        shared = tensors.get("blk.0.ffn_up_shexp.weight") or next(
            (t for n, t in tensors.items() if n.endswith("ffn_up_shexp.weight")), None)
        if shared is not None:
            mc.shared_expert_intermediate_size = int(field(f"{arch}.expert_shared_feed_forward_length", 0)
                                                     or shared.shape[1])
    if arch == "granitemoe":
        _granite_scalars(mc, field)
    for family in (deepseek, gemma3, gpt_oss, qwen3_next):  # families that describe their own layers
        if arch in family.GGUF_LAYOUTS:
            family.from_gguf(mc, arch, field, tensors)
            return mc, reader
    mc.layers = tuple(_layer(arch, field, tensors, i, head_dim) for i in range(mc.num_layers))
    return mc, reader


def _granite_scalars(mc: ModelConfig, field) -> None:
    """Granite's multipliers under the names llama.cpp's converter gives them; its shared expert is ungated."""
    if mc.shared_expert_intermediate_size:
        mc.architecture = "GraniteMoeSharedForCausalLM"
    mc.shared_expert_gated = False
    mc.embedding_multiplier = float(field("granitemoe.embedding_scale", 1.0))
    mc.residual_multiplier = float(field("granitemoe.residual_scale", 1.0))
    mc.logits_scaling = float(field("granitemoe.logit_scale", 1.0))
    scale = field("granitemoe.attention.scale")
    mc.attention_scale = float(scale) if scale is not None else None


def _layer(arch: str, field, tensors, i: int, head_dim: int) -> LayerSpec:
    step = _NO_ROPE_STEP.get(arch)
    # phi3's converter writes 0 for "no window" (Phi-4)
    window = field(f"{arch}.attention.sliding_window") if arch in _WINDOWED else None
    q_norm = tensors.get(f"blk.{i}.attn_q_norm.weight")
    attention = attention_of(window or None,
                             rope=step is None or (i + 1) % step != 0,
                             qk_norm=None if q_norm is None else "full" if q_norm.n_elements > head_dim else "head")
    return LayerSpec(attention, MOE_SOFTMAX_TOPK if f"blk.{i}.ffn_gate_inp.weight" in tensors else DENSE)


def _rope_scaling(path: Path, arch: str, field, tensors) -> dict | None:
    import numpy as np

    if "rope_factors_long.weight" in tensors:  # phi3's LongRoPE, as its converter writes it
        if "rope_factors_short.weight" not in tensors:
            raise ModelLoadError(f"{path}: GGUF rope_factors_long without rope_factors_short")
        longest = int(field(f"{arch}.context_length", 4096))
        trained = int(field(f"{arch}.rope.scaling.original_context_length") or longest)
        attention = field(f"{arch}.rope.scaling.attn_factor")
        if attention is None:
            attention = 1.0 if longest <= trained else math.sqrt(1 + math.log(longest / trained) / math.log(trained))
        return {"rope_type": "longrope", "original_max_position_embeddings": trained,
                "attention_factor": float(attention), "long": False,
                **{f"{kind}_factor": np.asarray(tensors[f"rope_factors_{kind}.weight"].data, dtype=np.float32)
                   .reshape(-1).tolist() for kind in ("short", "long")}}
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
