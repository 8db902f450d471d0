"""Memory arithmetic with the real sizes of quantized weights: pure functions of a model's shapes.

What a model holds on the device: its non-expert weights, the experts kept resident, and a KV cache.
The expert part is what `moe_gpu_experts` trades: offloaded experts stay in host memory, in their
quantized form too (backend/models/expert_cache.py).
"""

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from backend.model_config import ModelConfig
from backend.quant.attention_sizes import NORMS, attention_bytes, small_float_bytes, tensor_bytes
from backend.quant.formats import BY_NAME

# recipe(kind, layer or None, config) -> format name; kinds are GGUF tensor kinds (attn_q, ffn_down_exps, ...)
Recipe = Callable[[str, int | None, ModelConfig], str]


def _use_more_bits(layer: int, layers: int) -> bool:
    # llama.cpp's quantizer (llama-quant.cpp): the first and last eighth, and every third layer between.
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def q4_k_m(kind: str, layer: int | None, cfg: ModelConfig) -> str:
    """The tensor formats llama.cpp's Q4_K_M picks (llama_tensor_get_type), for the layouts we run."""
    if kind == "output":
        return "Q6_K"
    if kind == "attn_v":
        if cfg.num_experts == 8:
            return "Q8_0"  # 8-expert models (Mixtral): ~128 MB more for attention quality
        return "Q6_K" if _use_more_bits(layer, cfg.num_layers) else "Q4_K"
    if kind in ("ffn_down", "ffn_down_exps"):
        return "Q6_K" if _use_more_bits(layer, cfg.num_layers) else "Q4_K"
    if kind == "attn_output" and cfg.num_experts == 8:
        return "Q5_K"
    if kind in ("ffn_gate_inp", "ffn_gate_inp_shexp", NORMS):
        return "F32"  # routers, norms and biases are never quantized
    return "Q4_K"


@dataclass
class WeightBytes:
    dense: int  # everything but the routed experts: embeddings, attention, dense MLPs, shared experts, norms
    experts: int  # all routed experts of all layers
    per_expert: list[int]  # bytes of one expert (gate + up + down), per layer (0 for dense layers)

    @property
    def total(self) -> int:
        return self.dense + self.experts

    def resident(self, gpu_experts: int | None) -> int:
        """On the device with `gpu_experts` experts per layer resident (None: all)."""
        if gpu_experts is None:
            return self.total
        return self.dense + sum(b * gpu_experts for b in self.per_expert)

    def host(self, gpu_experts: int | None, num_experts: int, top_k: int, cpu_compute: bool = False) -> int:
        """In host memory with `gpu_experts` slots per layer: the experts that do not stay on the device for good
        (all but gpu_experts - top_k of them, the slots that rotate: backend/models/expert_cache.py; with
        cpu_compute, all but gpu_experts, computed where they are: backend/models/split_experts.py)."""
        if gpu_experts is None or gpu_experts >= num_experts:
            return 0
        kept = gpu_experts if cpu_compute else gpu_experts - max(1, min(top_k, gpu_experts))
        return sum(b * (num_experts - kept) for b in self.per_expert)


def weight_bytes(cfg: ModelConfig, recipe: Recipe) -> WeightBytes:
    h = cfg.hidden_size
    small = small_float_bytes(lambda kind: recipe(kind, None, cfg))  # an element of a norm, a bias or a sink
    dense = tensor_bytes(recipe("token_embd", None, cfg), cfg.vocab_size, h) + small * h
    if not cfg.tie_word_embeddings:
        dense += tensor_bytes(recipe("output", None, cfg), cfg.vocab_size, h)
    experts, per_expert = 0, []
    for i in range(cfg.num_layers):
        fmt = lambda kind, i=i: recipe(kind, i, cfg)  # noqa: E731
        norms = 4 if cfg.sandwich_norms else 2  # Gemma's sandwich: each branch's input and output normed
        dense += norms * small * h + attention_bytes(cfg, cfg.layers[i].attention, fmt)
        if cfg.layers[i].mlp.kind == "dense":
            inter = cfg.intermediate_size
            dense += sum(tensor_bytes(fmt(kind), inter, h) for kind in ("ffn_gate", "ffn_up"))  # mixes differ
            dense += tensor_bytes(fmt("ffn_down"), h, inter)
            per_expert.append(0)
            continue
        inter = cfg.moe_intermediate_size
        one = (
            tensor_bytes(fmt("ffn_gate_exps"), inter, h)
            + tensor_bytes(fmt("ffn_up_exps"), inter, h)
            + tensor_bytes(fmt("ffn_down_exps"), h, inter)
        )
        per_expert.append(one)
        experts += one * cfg.num_experts
        dense += tensor_bytes(fmt("ffn_gate_inp"), cfg.num_experts, h)
        if cfg.layers[i].mlp.bias:  # gpt-oss's: the router's, and each expert's on gate, up and down
            dense += small * cfg.num_experts * (1 + 2 * inter + h)
        if cfg.layers[i].mlp.router == "sigmoid_bias":
            dense += small * cfg.num_experts  # the router's selection bias (exp_probs_b)
        if cfg.shared_expert_intermediate_size:
            s = cfg.shared_expert_intermediate_size
            dense += sum(tensor_bytes(fmt(kind), s, h) for kind in ("ffn_gate_shexp", "ffn_up_shexp"))
            dense += tensor_bytes(fmt("ffn_down_shexp"), h, s)
            if cfg.shared_expert_gated:  # its gate: one row
                dense += tensor_bytes(fmt("ffn_gate_inp_shexp"), 1, h)
    return WeightBytes(dense, experts, per_expert)


def fit_gpu_experts(weights: WeightBytes, budget: int, reserved: int, num_experts: int) -> int | None:
    """The moe_gpu_experts that fits `budget` once `reserved` (KV cache, activations) is counted: None when
    every expert fits, else the largest count per layer. Raises when not even one expert per layer fits."""
    room = budget - reserved
    if weights.resident(None) <= room:
        return None
    for n in range(num_experts - 1, 0, -1):
        if weights.resident(n) <= room:
            return n
    gib = 2**30
    raise ValueError(
        f"the model needs {weights.resident(1) / gib:.1f} GiB with one expert per layer resident and "
        f"{reserved / gib:.1f} GiB reserved; the budget is {budget / gib:.1f} GiB"
    )


def float_name(dtype: torch.dtype) -> str:
    return {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}[dtype]


def linear_recipe(fmt: str, dtype: torch.dtype) -> Recipe:
    """The decoder's linear layers and experts in `fmt`; embeddings, output, routers, norms and biases in the compute
    dtype, and so are the layers whose inputs are not whole blocks of `fmt` (what hf_quantize.replace_layers and
    random_blocks.py build)."""
    name, block = float_name(dtype), BY_NAME[fmt].block
    kept = ("token_embd", "output", "ffn_gate_inp", "ffn_gate_inp_shexp", "attn_kv_b", NORMS)

    def recipe(kind: str, layer: int | None, cfg: ModelConfig) -> str:
        if kind in kept or any(width % block for width in input_widths(kind, layer, cfg)):
            return name
        return fmt

    return recipe


def input_widths(kind: str, layer: int | None, cfg: ModelConfig) -> tuple[int, ...]:
    """The input widths of the layer a decoder tensor of `kind` belongs to: its weight's columns, and for an expert
    stack both the hidden and the expert's width (replace_layers keeps a stack whole: gate, up and down)."""
    attention = cfg.layers[layer].attention if layer is not None else None
    if kind.endswith("_exps"):
        return cfg.hidden_size, cfg.moe_intermediate_size
    if kind == "ffn_down":
        return (cfg.intermediate_size,)
    if kind == "ffn_down_shexp":
        return (cfg.shared_expert_intermediate_size,)
    if kind == "attn_q_b":
        return (attention.mla.q_lora_rank,)
    if kind == "attn_output":
        return (cfg.num_heads * (attention.mla.v_head_dim if attention.kind == "mla" else cfg.head_dim),)
    if kind == "ssm_out":
        return (attention.linear.num_value_heads * attention.linear.value_head_dim,)
    return (cfg.hidden_size,)  # every other projection reads the hidden state


def hf_recipe(mode: str, dtype: torch.dtype) -> Recipe:
    """A Hugging Face checkpoint quantized at load (quantization="int8" | "int4")."""
    from backend.quant.hf_quantize import MODES

    return linear_recipe(MODES[mode], dtype)


def loaded_recipe(reader, quantization: str | None, source, dtype: torch.dtype) -> Recipe:
    """The formats a model will hold once load_model has loaded it with these settings. source: the loader's
    ModelSource; a Hugging Face checkpoint's experts stored as MXFP4 blocks stay MXFP4 whatever the quantization
    (weights.keep_stored_formats)."""
    if source.random_format is not None:
        return linear_recipe(source.random_format, dtype)
    checkpoint = source.path if reader is None and not source.random_weights else None
    floats = lambda kind, layer, cfg: float_name(dtype)  # noqa: E731
    if reader is not None:
        return file_recipe(reader, dtype) if quantization is None else floats  # "dequantize": all in floats
    recipe = hf_recipe(quantization, dtype) if quantization in ("int8", "int4") else floats
    return _stored_experts(recipe, checkpoint) if checkpoint is not None else recipe


def _stored_experts(recipe: Recipe, checkpoint: Path) -> Recipe:
    """`recipe` but for the expert stacks a load keeps as the checkpoint stores them (gpt-oss's MXFP4)."""
    from backend.weights import mxfp4_expert_layers

    layers = mxfp4_expert_layers(checkpoint)
    kinds = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")
    return lambda kind, layer, cfg: "MXFP4" if kind in kinds and layer in layers else recipe(kind, layer, cfg)


# a linear-attention layer's fused tensors -> the kinds weight_bytes counts them as (attention_sizes._linear_bytes)
_FUSED_LINEAR = {"ssm_in": ("attn_qkv", "attn_gate"), "ssm_ba": ("ssm_beta", "ssm_alpha")}


def file_recipe(reader, dtype: torch.dtype = torch.float32) -> Recipe:
    """What a GGUF file's tensors become once loaded: every format of formats.py stays as its blocks, everything else
    (F16/BF16, and the types gguf-py reads that we do not compute on, dequantized at load) is held in the compute
    dtype. Fused tensors (phi3's attn_qkv, and its ffn_up holding gate's rows then up's) give their format to the
    parts weight_bytes counts."""
    formats = {}
    for t in reader.tensors:
        parts = t.name.split(".")
        if (
            parts[-1] == "bias"
        ):  # floats beside their weight (gpt-oss's expert stacks'), which names the format
            continue
        layer, kind = (int(parts[1]), parts[2]) if parts[0] == "blk" else (None, parts[0])
        fmt = BY_NAME.get(t.tensor_type.name)
        formats[(kind, layer)] = fmt.name if fmt is not None else float_name(dtype)
    for (kind, layer), name in list(formats.items()):
        if kind == "attn_qkv":
            formats.update({(part, layer): name for part in ("attn_q", "attn_k", "attn_v")})
        elif kind == "ffn_up" and ("ffn_gate", layer) not in formats:
            formats[("ffn_gate", layer)] = name
        elif kind == "ffn_gate_up_exps":  # the converter's fused gate | up expert stack
            formats.update({(part, layer): name for part in ("ffn_gate_exps", "ffn_up_exps")})
        elif kind in _FUSED_LINEAR:  # older qwen3next files' grouped projections of the linear layers
            formats.update({(part, layer): name for part in _FUSED_LINEAR[kind]})
    for _, layer in [k for k in formats if k[0] in ("attn_kv_b", "attn_k_b", "attn_v_b")]:
        formats[("attn_kv_b", layer)] = float_name(dtype)  # deepseek2's kv_b: expanded at load (gguf_load.py)
    return lambda kind, layer, cfg: formats.get((kind, layer), float_name(dtype))


def module_bytes(model: nn.Module) -> int:
    """What a loaded model holds in its own memory: parameters and buffers (quantized blocks, CPU repacks,
    expert slots), the latent attention's kv_b halves as our C decode rows read them (made at load:
    mla.pack_head_weights), not the host copies of offloaded experts. Shared tensors count once."""
    seen, total = set(), 0
    buffers = [b for name, b in model.named_buffers() if not name.endswith("cos_sin")]  # a table, not weights
    for t in [*model.parameters(), *buffers, *_expert_slots(model), *kv_b_decode_copies(model)]:
        if t is None or t.data_ptr() in seen or t.device.type == "meta":
            continue
        seen.add(t.data_ptr())
        total += t.numel() * t.element_size()
    return total


def host_expert_bytes(model: nn.Module) -> int:
    """The host copies of offloaded experts (in their stored form: quantized experts stay quantized)."""
    return sum(
        m.expert_cache.host_bytes() for m in model.modules() if getattr(m, "expert_cache", None) is not None
    )


def _expert_slots(model: nn.Module) -> list[torch.Tensor]:
    return [
        t for m in model.modules() if getattr(m, "expert_cache", None) is not None for t in m.expert_cache.dev
    ]


def kv_b_decode_copies(model: nn.Module) -> list[torch.Tensor]:
    """The tensors of each latent attention layer's HeadWeights that are its own (not views of kv_b's weight)."""
    tensors = []
    for layer in (m for m in model.modules() if getattr(m, "head_weights", None) is not None):
        kv_b, held = layer.kv_b_proj.weight.untyped_storage().data_ptr(), layer.head_weights
        tensors += [
            t
            for t in (held.uk, held.uk_scales, held.uv, held.uv_scales)
            if t is not None and t.untyped_storage().data_ptr() != kv_b
        ]
    return tensors
