"""Read safetensors tensors under Hugging Face names; load them (or a GGUF's floats) into a CausalLM."""

import json
import logging
import re
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn

from backend.families import deepseek, gpt_oss, gpt_oss_weights
from backend.model_config import ModelLoadError

log = logging.getLogger(__name__)

_EXPERT = re.compile(r"^(.*)\.experts\.(\d+)\.(w1|w2|w3|gate_proj|up_proj|down_proj)\.weight$")
_EXPERT_ROLE = {"w1": 0, "gate_proj": 0, "w3": 1, "up_proj": 1, "w2": None, "down_proj": None}
_FUSED = {".q_proj.": (".qkv_proj.", 0), ".k_proj.": (".qkv_proj.", 1), ".v_proj.": (".qkv_proj.", 2),
          ".gate_proj.": (".gate_up_proj.", 0), ".up_proj.": (".gate_up_proj.", 1),
          # Qwen3.5's linear attention: q|k|v then z, b then a (GatedDeltaNet's fused projections)
          ".in_proj_qkv.": (".in_proj_qkvz.", 0), ".in_proj_z.": (".in_proj_qkvz.", 1),
          ".in_proj_b.": (".in_proj_ba.", 0), ".in_proj_a.": (".in_proj_ba.", 1)}  # theirs -> (ours, its shard)
# Whole tensors under other names (after Mixtral's block_sparse_moe -> mlp): Granite-MoE's expert stacks (gate
# rows, then up rows, as ours), router and shared expert; transformers 5's own stacked expert names.
_RENAMED = ((".mlp.input_linear.weight", ".mlp.w_gate_up"), (".mlp.output_linear.weight", ".mlp.w_down"),
            (".mlp.router.layer.weight", ".mlp.gate.weight"), (".mlp.router.weight", ".mlp.gate.weight"),
            (".mlp.experts.gate_up_proj", ".mlp.w_gate_up"), (".mlp.experts.down_proj", ".mlp.w_down"),
            (".shared_mlp.input_linear.", ".mlp.shared_expert.gate_up_proj."),
            (".shared_mlp.output_linear.", ".mlp.shared_expert.down_proj."),
            (".mlp.shared_experts.", ".mlp.shared_expert."),  # DeepSeek's and GLM-4.5's
            (".mlp.gate.e_score_correction_bias", ".mlp.e_score_correction_bias"),
            (".mlp.exp_probs_b.bias", ".mlp.e_score_correction_bias"),  # the same, as llama.cpp names it
            (".linear_attn.", ".self_attn."),  # Qwen3-Next's and Qwen3.5's linear layers: each layer's attention
            ("model.language_model.", "model."),  # Qwen3.5's and Gemma 3's multimodal checkpoints: the text model
            ("language_model.model.", "model."), ("language_model.lm_head.", "lm_head."))  # Gemma 3's, as released
# Tensors of parts that do not run: the vision towers and projectors of Qwen3.5 and Gemma 3 (text is served, images
# are not), Qwen3-Next's and Qwen3.5's multi-token prediction head
_VISION = ("model.visual.", "vision_tower.", "multi_modal_projector.", "model.vision_tower.",
           "model.multi_modal_projector.")
_SKIPPED = (*_VISION, "mtp.")


def safetensors_files(directory: Path) -> list[Path]:
    index = directory / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise ModelLoadError(f"{index}: not a valid safetensors index ({e})") from None
        files = [directory / name for name in sorted(set(weight_map.values()))]
        missing = [str(f) for f in files if not f.exists()]
        if missing:
            raise ModelLoadError(f"{index} names shards that are missing: {', '.join(missing)}")
        return files
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{directory}: no *.safetensors weights found (model.safetensors or a sharded index)")
    return files


def iter_safetensors(directory: Path) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import SafetensorError, safe_open

    for file in safetensors_files(directory):
        try:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                    yield name, f.get_tensor(name)
        except (SafetensorError, OSError) as e:
            raise ModelLoadError(f"{file}: cannot read safetensors weights ({e}); the file may be corrupt") from None


def checkpoint_names(directory: Path) -> set[str]:
    """The names of every tensor in a checkpoint's safetensors files (read from their headers)."""
    from safetensors import safe_open

    names = set()
    for file in safetensors_files(directory):
        with safe_open(str(file), framework="pt") as f:
            names.update(f.keys())
    return names


def keep_stored_formats(model: nn.Module, directory: Path, dtype: torch.dtype) -> None:
    """On the meta model, before it is given memory: the checkpoint's experts that compute as stored (gpt-oss's
    MXFP4 blocks) in place of float stacks."""
    if model.config.architecture not in gpt_oss.ARCHITECTURES:
        return
    gpt_oss_weights.keep_mxfp4(model, checkpoint_names(directory), dtype)


def mxfp4_expert_layers(directory: Path) -> set[int]:
    """The layers whose experts keep_stored_formats keeps as the checkpoint's MXFP4 blocks (what weight_sizes counts
    them as); only gpt-oss checkpoints have such tensors."""
    return {int(mlp.split(".")[-2]) for mlp in gpt_oss_weights.mxfp4_mlps(checkpoint_names(directory))}


def _shard_rows(param: str, shard: int, model: nn.Module) -> tuple[int, int]:
    cfg = model.config
    if ".qkv_proj." in param:  # q's rows: twice num_heads * head_dim with an output gate (Qwen3-Next)
        kv = cfg.num_kv_heads * cfg.head_dim
        q = model.get_parameter(param).shape[0] - 2 * kv
        return [(0, q), (q, q + kv), (q + kv, q + 2 * kv)][shard]
    if ".in_proj_qkvz." in param:
        conv = model.get_submodule(param.rsplit(".", 2)[0]).conv_dim
        return (0, conv) if shard == 0 else (conv, model.get_parameter(param).shape[0])
    size = model.get_parameter(param).shape[0] // 2  # gate_up_proj: gate rows then up rows
    return (0, size) if shard == 0 else (size, 2 * size)


def load_weights(model: nn.Module, tensors: Iterator[tuple[str, torch.Tensor]], source: str) -> None:
    """Copy every checkpoint tensor into the model's (fused) parameters; every element must be written."""
    params = dict(model.named_parameters(remove_duplicate=False))
    written = {name: 0 for name in params}
    if model.config.architecture in gpt_oss.ARCHITECTURES:  # its experts' layout (and MXFP4) as ours
        tensors = gpt_oss_weights.as_ours(tensors, source, model)
    vision = 0
    for name, tensor in tensors:
        if name.endswith("rotary_emb.inv_freq") or name.startswith(_SKIPPED):
            vision += name.startswith(_VISION)
            continue
        if deepseek.beyond_layers(name, model.config):  # DeepSeek-V3's and GLM-4.5's multi-token prediction layers
            continue
        name = name.replace(".block_sparse_moe.", ".mlp.")  # Mixtral's name for the sparse block
        for theirs, ours in _RENAMED:
            name = name.replace(theirs, ours)
        target, rows, expert = name, None, None
        if m := _EXPERT.match(name):
            prefix, expert, role = m.group(1), int(m.group(2)), _EXPERT_ROLE[m.group(3)]
            target = f"{prefix}.w_down" if role is None else f"{prefix}.w_gate_up"
            if role is not None:
                half = params[target].shape[1] // 2 if target in params else 0
                rows = (0, half) if role == 0 else (half, 2 * half)
        else:
            for ours, (fused, shard) in _FUSED.items():
                if ours in name and name.replace(ours, fused) in params:  # MLA keeps its q_proj apart
                    target = name.replace(ours, fused)
                    rows = _shard_rows(target, shard, model)
                    break
        if target not in params:
            if name == "lm_head.weight" and model.config.tie_word_embeddings:
                continue
            raise ModelLoadError(f"{source}: unexpected tensor {name!r} (does config.json match these weights?)")
        dest = params[target].data
        if expert is not None:
            dest = dest[expert]
        if rows is not None:
            dest = dest[rows[0]:rows[1]]
        if tuple(dest.shape) != tuple(tensor.shape):
            raise ModelLoadError(f"{source}: tensor {name!r} has shape {tuple(tensor.shape)}, the model expects "
                                 f"{tuple(dest.shape)} from its config; does config.json belong to these weights?")
        dest.copy_(tensor)
        written[target] += tensor.numel()
    if "lm_head.weight" in written and written["lm_head.weight"] == 0 and not model.config.tie_word_embeddings:
        # Some checkpoints tie embeddings without saying so in config.json.
        model.lm_head.weight = model.model.embed_tokens.weight
        written["lm_head.weight"] = params["lm_head.weight"].numel()
    if vision:
        log.info("%s: the vision tower and projector (%d tensors) are not loaded: text is served, images are not",
                 source, vision)
    missing = [n for n, count in written.items() if count != params[n].numel()]
    if model.config.tie_word_embeddings:
        missing = [n for n in missing if n != "lm_head.weight"]
    if missing:
        shown = ", ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
        raise ModelLoadError(f"{source}: weights missing for {shown}")


def materialise(model: torch.nn.Module, device: torch.device | str) -> torch.nn.Module:
    """model.to_empty(device): uninitialised storage for every meta parameter and buffer, made by torch.empty
    rather than empty_like of a meta tensor, whose python kernel (torch._refs) imports sympy: 1 s of start-up."""
    return model._apply(lambda t: torch.empty(t.shape, dtype=t.dtype, device=device) if t.is_meta else t)

