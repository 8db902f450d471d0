"""A tiny gpt-oss GGUF written with gguf.GGUFWriter as llama.cpp's convert_hf_to_gguf.py lays one out (GptOssModel;
names and keys from gguf-py's constants): gate and up experts as two stacks split from the checkpoint's interleaved
rows, their biases likewise, sinks as attn_sinks.weight, the norm before the MoE as post_attention_norm, and the
experts in MXFP4 (GGML type 39, repacked from OpenAI's blocks as the converter repacks them, never requantized), F16
or F32. The reference is the same Hugging Face model with the experts' MXFP4 values as floats."""

import json
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType as T
from gguf import GGUFWriter, RopeScalingType
from safetensors.torch import load_file

from backend.families.gpt_oss_weights import mxfp4_decode
from tests.backend.tiny_gguf_parts import add_tokenizer, add_widths, close, write_reference
from tests.backend.tiny_models import build_model

_GLOBAL = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
_LAYER = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "post_attention_norm",
    "mlp.router": "ffn_gate_inp",
}


def ggml_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> np.ndarray:
    """OpenAI's MXFP4 (blocks [..., G, 16]: element 2j in byte j's low nibble, 2j + 1 in its high; scales [..., G])
    as GGML's MXFP4 rows [..., G * 17]: per block its E8M0 byte, then 16 bytes whose byte j holds element j in its
    low nibble and element j + 16 in its high one (gguf-py's MXFP4.dequantize_blocks reads them so)."""
    codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).flatten(-2)  # [..., G, 32] in element order
    packed = codes[..., :16] | (codes[..., 16:] << 4)
    return torch.cat([scales[..., None], packed], dim=-1).flatten(-2).numpy()


def _metadata(w: GGUFWriter, cfg: dict, hf_dir: Path) -> None:
    rope = cfg["rope_parameters"]
    add_widths(w, cfg)
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_key_length(cfg["head_dim"])
    w.add_value_length(cfg["head_dim"])
    w.add_rope_freq_base(rope["rope_theta"])
    w.add_expert_count(cfg["num_local_experts"])
    w.add_expert_used_count(cfg["num_experts_per_tok"])
    w.add_expert_feed_forward_length(cfg["intermediate_size"])
    w.add_sliding_window(cfg["sliding_window"])
    w.add_rope_scaling_type(RopeScalingType.YARN)
    w.add_rope_scaling_factor(rope["factor"])
    w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    w.add_rope_scaling_yarn_beta_fast(rope["beta_fast"])
    w.add_rope_scaling_yarn_beta_slow(rope["beta_slow"])
    add_tokenizer(w, cfg, hf_dir)


def random_mxfp4(shape: tuple[int, int, int], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """OpenAI-layout blocks and scales of an [E, rows, cols] stack: every code, scales 2^-7 .. 2^-4."""
    g = torch.Generator().manual_seed(seed)
    experts, rows, cols = shape
    blocks = torch.randint(0, 256, (experts, rows, cols // 32, 16), dtype=torch.uint8, generator=g)
    return blocks, torch.randint(120, 124, (experts, rows, cols // 32), dtype=torch.uint8, generator=g)


def _experts(writer: GGUFWriter, layer: int, name: str, rows: torch.Tensor, blocks, scales, fmt: str) -> None:
    if fmt == "MXFP4":
        writer.add_tensor(f"blk.{layer}.{name}.weight", ggml_mxfp4(blocks, scales), raw_dtype=T.MXFP4)
    else:
        writer.add_tensor(
            f"blk.{layer}.{name}.weight", rows.numpy().astype(np.float16 if fmt == "F16" else np.float32)
        )


def write_gguf(
    root: Path, experts: str = "MXFP4", layers: int = 4, fused: bool = False, **extra
) -> tuple[Path, Path]:
    """(the GGUF file, the Hugging Face directory of the model it holds). experts: MXFP4, F16 or F32 (the same
    values: MXFP4's are exact in both). fused: gate and up as the converter's fuse_gate_up_exps writes them, one
    ffn_gate_up_exps stack (and bias) of gate's rows then up's. The clamp's limit is llama.cpp's fixed 7.0."""
    label = f"{experts}{'-fused' if fused else ''}"
    hf_dir = build_model(
        "gpt_oss", root / f"gpt-oss-{label}-hf", num_hidden_layers=layers, swiglu_limit=7.0, **extra
    )
    cfg = json.loads((hf_dir / "config.json").read_text())
    out = root / f"gpt-oss-{label}.gguf"
    writer = GGUFWriter(str(out), "gpt-oss")
    _metadata(writer, cfg, hf_dir)
    state, ref = load_file(str(hf_dir / "model.safetensors")), {}
    for n, (name, tensor) in enumerate(sorted(state.items())):
        parts = name.split(".")
        ref[name] = tensor
        if name in _GLOBAL:
            writer.add_tensor(_GLOBAL[name], tensor.numpy())
        elif parts[-1] == "sinks":
            writer.add_tensor(f"blk.{parts[2]}.attn_sinks.weight", tensor.numpy())
        elif parts[-1] in ("gate_up_proj", "down_proj"):  # [E, in, out]: MXFP4 drawn for it
            layer, (e, cols, rows) = int(parts[2]), tensor.shape
            blocks, scales = random_mxfp4((e, rows, cols), 1000 + n)
            values = mxfp4_decode(blocks, scales)  # [E, out, in]
            ref[name] = values.transpose(1, 2).contiguous()
            if parts[-1] == "down_proj":
                _experts(writer, layer, "ffn_down_exps", values, blocks, scales, experts)
            elif fused:  # gate's rows (the even ones), then up's
                halves = [torch.cat([t[:, 0::2], t[:, 1::2]], dim=1) for t in (values, blocks, scales)]
                _experts(writer, layer, "ffn_gate_up_exps", *halves, experts)
            else:  # the converter's split of the interleaved rows: gate even, up odd
                for kind, first in (("ffn_gate_exps", 0), ("ffn_up_exps", 1)):
                    _experts(
                        writer,
                        layer,
                        kind,
                        values[:, first::2],
                        blocks[:, first::2],
                        scales[:, first::2],
                        experts,
                    )
        elif parts[-1] == "gate_up_proj_bias" and fused:
            writer.add_tensor(
                f"blk.{parts[2]}.ffn_gate_up_exps.bias",
                torch.cat([tensor[:, 0::2], tensor[:, 1::2]], dim=1).numpy(),
            )
        elif parts[-1] == "gate_up_proj_bias":
            writer.add_tensor(f"blk.{parts[2]}.ffn_gate_exps.bias", tensor[:, 0::2].contiguous().numpy())
            writer.add_tensor(f"blk.{parts[2]}.ffn_up_exps.bias", tensor[:, 1::2].contiguous().numpy())
        elif parts[-1] == "down_proj_bias":
            writer.add_tensor(f"blk.{parts[2]}.ffn_down_exps.bias", tensor.numpy())
        else:
            writer.add_tensor(f"blk.{parts[2]}.{_LAYER['.'.join(parts[3:-1])]}.{parts[-1]}", tensor.numpy())
    close(writer)
    return out, write_reference(out, hf_dir, {k: v.float() for k, v in ref.items()})
