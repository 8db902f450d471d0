"""Load a model (Hugging Face directory or GGUF file) and its tokenizer."""

import hashlib
import json
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch

from backend.home import cache_dir
from backend.model_config import SUPPORTED_ARCHITECTURES, ModelConfig, ModelLoadError, from_hf_config
from backend.model_store import resolve
from backend.models.transformer import CausalLM
from backend.weights import iter_gguf, iter_safetensors, load_weights

# GGUF layouts whose tensor names and rotary permutation are verified against transformers (SmolLM2's test).
# Qwen2/Qwen3 GGUFs use other names for biases and norms; they stay refused until a test covers them.
_GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM"}


@dataclass
class ModelSource:
    """Where a model's files are: a Hugging Face directory, or a GGUF file."""

    path: Path
    gguf_file: Path | None = None
    # A config.json marked "scriptorium_random_weights": the weights are drawn at random on the device
    # (benchmarks of real shapes with nothing to download, bench/device.py).
    random_weights: bool = False

    @property
    def name(self) -> str:
        return str(self.gguf_file or self.path)


def locate(model: str) -> ModelSource:
    path = resolve(model)
    if path.is_file():
        if path.suffix != ".gguf":
            raise ModelLoadError(f"{path}: a model is a Hugging Face directory (with config.json) or a .gguf file")
        return ModelSource(path.parent, path)
    if (path / "config.json").exists():
        try:
            marked = bool(json.loads((path / "config.json").read_text()).get("scriptorium_random_weights"))
        except (ValueError, AttributeError):
            marked = False
        return ModelSource(path, random_weights=marked)
    ggufs = sorted(path.glob("*.gguf"))
    if len(ggufs) == 1:
        return ModelSource(path, ggufs[0])
    if ggufs:
        raise ModelLoadError(f"{path} holds several .gguf files ({', '.join(g.name for g in ggufs)}); pass one of them")
    raise ModelLoadError(f"{path}: no config.json and no .gguf file; a model is a Hugging Face directory or a GGUF file")


def read_config(source: ModelSource) -> tuple[ModelConfig, object]:
    """The model's config and, for GGUF, the open reader (its tensors are read later)."""
    if source.gguf_file is None:
        config_path = source.path / "config.json"
        try:
            cfg = json.loads(config_path.read_text())
        except json.JSONDecodeError as e:
            raise ModelLoadError(f"{config_path}: not valid JSON ({e})") from None
        mc = from_hf_config(cfg, str(config_path))
        gen_path = source.path / "generation_config.json"
        if gen_path.exists():
            gen = json.loads(gen_path.read_text())
            eos = gen.get("eos_token_id")
            extra = eos if isinstance(eos, list) else ([] if eos is None else [eos])
            mc.eos_token_ids = sorted(set(mc.eos_token_ids) | set(extra))
        return mc, None
    return _gguf_config(source.gguf_file)


def _gguf_config(path: Path) -> tuple[ModelConfig, object]:
    import gguf

    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as e:  # the reader raises assorted errors on a truncated or foreign file
        raise ModelLoadError(f"{path}: not a readable GGUF file ({e})") from None

    def field(key, default=None):
        f = reader.fields.get(key)
        return default if f is None else f.contents()

    arch = field("general.architecture")
    if arch not in _GGUF_ARCHITECTURES:
        raise ModelLoadError(
            f"{path}: GGUF architecture {arch!r} is not supported; supported: {', '.join(_GGUF_ARCHITECTURES)}"
        )
    scaling_type = field(f"{arch}.rope.scaling.type", "none")
    if scaling_type not in ("none", "linear"):
        raise ModelLoadError(f"{path}: GGUF rope scaling {scaling_type!r} is not supported")
    heads = int(field(f"{arch}.attention.head_count"))
    hidden = int(field(f"{arch}.embedding_length"))
    names = {t.name for t in reader.tensors}
    mc = ModelConfig(
        architecture=_GGUF_ARCHITECTURES[arch],
        vocab_size=int(field(f"{arch}.vocab_size", 0) or len(field("tokenizer.ggml.tokens"))),
        hidden_size=hidden,
        intermediate_size=int(field(f"{arch}.feed_forward_length")),
        num_layers=int(field(f"{arch}.block_count")),
        num_heads=heads,
        num_kv_heads=int(field(f"{arch}.attention.head_count_kv", heads)),
        head_dim=int(field(f"{arch}.attention.key_length", hidden // heads)),
        rms_norm_eps=float(field(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(field(f"{arch}.rope.freq_base", 10000.0)),
        rope_scaling=(
            {"rope_type": "linear", "factor": float(field(f"{arch}.rope.scaling.factor"))}
            if scaling_type == "linear" else None
        ),
        max_position_embeddings=int(field(f"{arch}.context_length", 4096)),
        tie_word_embeddings="output.weight" not in names,
        eos_token_ids=[int(field("tokenizer.ggml.eos_token_id"))] if field("tokenizer.ggml.eos_token_id") is not None else [],
    )
    mc.qkv_bias = "blk.0.attn_q.bias" in names
    mc.qk_norm = "blk.0.attn_q_norm.weight" in names
    return mc, reader


DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16, "half": torch.float16}


def pick_dtype(dtype: str | torch.dtype, device: torch.device, config_dtype: str | None) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        chosen = dtype
    elif dtype == "auto":
        # On the CPU fp32 is both exact and fastest without bf16 matrix units; on CUDA, the checkpoint's dtype.
        if device.type == "cpu":
            return torch.float32
        chosen = DTYPES.get(str(config_dtype), torch.bfloat16)
    elif dtype in DTYPES:
        chosen = DTYPES[dtype]
    else:
        raise ValueError(f"dtype {dtype!r} is not supported; use auto, {', '.join(sorted(set(DTYPES)))}")
    if device.type == "cpu" and chosen == torch.float16:
        raise ValueError("dtype float16 is not supported on the CPU; use float32 or bfloat16")
    if device.type == "cuda" and chosen == torch.bfloat16 and not torch.cuda.is_bf16_supported():
        raise ValueError(f"{torch.cuda.get_device_name(device)} cannot run bfloat16; use dtype float16")
    if chosen not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"dtype {chosen} is not supported; use float32, bfloat16 or float16")
    return chosen


def load_model(source: ModelSource, config: ModelConfig, reader, dtype: torch.dtype, device: torch.device,
               max_positions: int, moe_gpu_experts: int | None = None) -> CausalLM:
    with torch.device("meta"):
        model = CausalLM(config, max_positions)
    # Cast while still on meta: materialising in fp32 first would need twice the memory (Mixtral: 187 GB).
    model = model.to(dtype)
    if source.random_weights:
        # Drawn where they will live; with experts offloaded, in host memory first (the model may not fit).
        # Seeded from config.json, so every load of one model (a target and itself as draft) is the same model.
        home = torch.device("cpu") if moe_gpu_experts else device
        model = model.to_empty(device=home)
        model.tie_weights()
        model.cos_sin = _cos_sin(config, max_positions).to(device)
        seed = zlib.crc32((source.path / "config.json").read_bytes())
        generator = torch.Generator(device=home).manual_seed(seed)
        with torch.no_grad():
            for name, param in model.named_parameters():
                param.fill_(1.0) if "norm" in name else param.normal_(0.0, 0.02, generator=generator)
            # Scale the logits so the next-token distribution is peaked like a trained model's: with the
            # near-flat logits of raw random weights, rounding alone would decide the argmax.
            model.model.norm.weight.fill_(8.0)
        _offload(model, moe_gpu_experts, device)
        return model.to(device).eval()
    model = model.to_empty(device="cpu")
    model.tie_weights()  # materialising meta tensors may have split the shared embedding
    model.cos_sin = _cos_sin(config, max_positions)  # kept in fp32; cast per batch like the reference does
    if reader is None:
        tensors = iter_safetensors(source.path)
    else:
        tensors = iter_gguf(reader, reader.fields["general.architecture"].contents(), config.num_heads,
                            config.num_kv_heads, source.name)
    with torch.no_grad():
        load_weights(model, tensors, source.name)
    _offload(model, moe_gpu_experts, device)
    return model.to(device).eval()


def _offload(model: CausalLM, slots: int | None, device: torch.device) -> None:
    if slots is None:
        return
    from backend.models.moe import SparseMoE

    layers = [m for m in model.modules() if isinstance(m, SparseMoE)]
    if not layers:
        raise ValueError("moe_gpu_experts is set but the model has no MoE layers")
    for layer in layers:
        layer.offload(slots, device)


def _cos_sin(config: ModelConfig, max_positions: int) -> torch.Tensor:
    from backend.kernels.rotary import cos_sin_table

    return cos_sin_table(config.head_dim, config.rope_theta, config.rope_scaling, max_positions)


def load_tokenizer(source: ModelSource):
    from transformers import AutoTokenizer

    if source.random_weights and not any(source.path.glob("tokenizer*")):
        return None  # a random-weight model for benchmarks takes token ids
    if source.gguf_file is None:
        try:
            return AutoTokenizer.from_pretrained(str(source.path))
        except (OSError, ValueError) as e:
            raise ModelLoadError(f"{source.path}: cannot load its tokenizer ({e})") from None
    # Converting a GGUF vocabulary takes seconds; keep the converted tokenizer under the cache directory.
    stat = source.gguf_file.stat()
    key = hashlib.sha256(f"{source.gguf_file.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    cached = cache_dir() / "tokenizers" / key
    if (cached / "tokenizer.json").exists():
        return AutoTokenizer.from_pretrained(str(cached))
    tokenizer = AutoTokenizer.from_pretrained(str(source.path), gguf_file=source.gguf_file.name)
    tmp = cached.with_name(cached.name + ".partial")
    tokenizer.save_pretrained(str(tmp))
    tmp.replace(cached) if not cached.exists() else None
    return tokenizer


__all__ = ["SUPPORTED_ARCHITECTURES", "ModelLoadError", "ModelSource", "load_model", "load_tokenizer", "locate",
           "pick_dtype", "read_config"]
