"""Load a model (Hugging Face directory or GGUF file) and its tokenizer."""

import contextlib
import hashlib
import json
import logging
import os
import shutil
import sys
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from backend.gguf_config import gguf_config
from backend.hf_config import from_hf_config
from backend.home import cache_dir
from backend.model_config import ModelConfig, ModelLoadError, as_id_list
from backend.model_store import resolve
from backend.models.transformer import CausalLM
from backend.plain_tokenizer import PlainTokenizer
from backend.quant.formats import BY_NAME
from backend.weights import iter_safetensors, keep_stored_formats, load_weights, materialise

log = logging.getLogger(__name__)

# quantization: None keeps the checkpoint's own format (a GGUF's blocks stay quantized); "dequantize"
# expands a GGUF's weights to the compute dtype at load (exact and larger; on the CPU, slower); "int8" and
# "int4" quantize a Hugging Face checkpoint's linear layers at load (backend/quant/hf_quantize.py).
QUANTIZATION_MODES = (None, "dequantize", "int8", "int4")


@dataclass
class ModelSource:
    """Where a model's files are: a Hugging Face directory, or a GGUF file."""

    path: Path
    gguf_file: Path | None = None
    # A config.json marked "scriptorium_random_weights": the weights are drawn at random on the device
    # (benchmarks of real shapes with nothing to download, bench/device.py).
    random_weights: bool = False
    random_format: str | None = None  # the marker names a GGUF format ("Q4_K"): random blocks of it

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
            marked = json.loads((path / "config.json").read_text()).get("scriptorium_random_weights")
        except (ValueError, AttributeError):
            marked = None
        fmt = marked if isinstance(marked, str) else None
        if fmt is not None and fmt not in BY_NAME:
            raise ModelLoadError(f"{path / 'config.json'}: scriptorium_random_weights={fmt!r} is not a format we "
                                 f"compute on; use true (floats) or one of {', '.join(BY_NAME)}")
        return ModelSource(path, random_weights=bool(marked), random_format=fmt)
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
            try:
                generation = json.loads(gen_path.read_text())
            except json.JSONDecodeError as e:
                raise ModelLoadError(f"{gen_path}: not valid JSON ({e})") from None
            if not isinstance(generation, dict):
                raise ModelLoadError(f"{gen_path}: must be a JSON object, got {type(generation).__name__}")
            extra = as_id_list(generation.get("eos_token_id"), str(gen_path))
            mc.eos_token_ids = sorted(set(mc.eos_token_ids) | set(extra))
        return mc, None
    return gguf_config(source.gguf_file)


@contextlib.contextmanager
def _no_init(dtype: torch.dtype):
    """Modules made with `dtype` as the default, and without their random initialisation: the weights are
    loaded (or drawn) afterwards, and initialising meta tensors goes through torch._refs, whose import of
    torch._dynamo costs 1.5 s of every start-up."""
    names = ("normal_", "uniform_", "kaiming_uniform_", "ones_", "zeros_")
    saved = {name: getattr(torch.nn.init, name) for name in names}
    default = torch.get_default_dtype()
    for name in names:
        setattr(torch.nn.init, name, lambda tensor, *args, **kwargs: tensor)
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(default)
        for name, fn in saved.items():
            setattr(torch.nn.init, name, fn)


def load_model(source: ModelSource, config: ModelConfig, reader, dtype: torch.dtype, device: torch.device,
               max_positions: int, moe_gpu_experts: int | None = None, quantization: str | None = None,
               products: str = "float32", moe_cpu_compute: bool = False) -> CausalLM:
    """products: what the CPU's quantized matmuls multiply (arithmetic.products; dtype is fp32 unless "float32").
    moe_cpu_compute: the experts moe_gpu_experts leaves in host memory are computed there (SplitExperts), not
    copied to the device (ExpertCache)."""
    if quantization not in QUANTIZATION_MODES:
        raise ValueError(f"quantization {quantization!r} is not supported; use None (the checkpoint's own "
                         "format), 'dequantize' (a GGUF's weights expanded at load), or 'int8' / 'int4' (a "
                         "Hugging Face checkpoint quantized at load)")
    if quantization in ("int8", "int4") and reader is not None:
        raise ValueError(f"quantization={quantization!r} quantizes a Hugging Face checkpoint at load; {source.name} is "
                         "a GGUF file, already quantized: leave quantization unset to run its own formats")
    if quantization == "dequantize" and reader is None:
        raise ValueError(f"quantization='dequantize' expands a GGUF file's weights; {source.name} is a Hugging Face "
                         "checkpoint, already in floats: leave quantization unset")
    # Made in the compute dtype on meta: materialising in fp32 first would need twice the memory (Mixtral:
    # 187 GB), and casting meta tensors goes through torch._refs (1 s of imports at every start-up).
    with torch.device("meta"), _no_init(dtype):
        model = CausalLM(config, max_positions)
    model = model.to(dtype)
    if source.random_weights:
        if quantization is not None:
            raise ValueError(f"{source.name}: a random-weight model takes no quantization setting")
        if source.random_format is not None:
            from backend.quant import random_blocks

            random_blocks.quantize_meta(model, BY_NAME[source.random_format], dtype)
        # Drawn where they will live; with experts offloaded, in host memory first (the model may not fit).
        # Seeded from config.json, so every load of one model (a target and itself as draft) is the same model.
        home = torch.device("cpu") if moe_gpu_experts else device
        model = materialise(model, home)
        model.tie_weights()
        seed = zlib.crc32((source.path / "config.json").read_bytes())
        generator = torch.Generator(device=home).manual_seed(seed)
        with torch.no_grad():
            for name, param in model.named_parameters():
                param.fill_(1.0) if "norm" in name else param.normal_(0.0, 0.02, generator=generator)
            # Scale the logits so the next-token distribution is peaked like a trained model's: with the
            # near-flat logits of raw random weights, rounding alone would decide the argmax.
            model.model.norm.weight.fill_(8.0)
            if source.random_format is not None:
                random_blocks.fill_random(model, generator)
    elif reader is None:
        keep_stored_formats(model, source.path, dtype)
        model = materialise(model, "cpu")
        model.tie_weights()  # materialising meta tensors may have split the shared embedding
        with torch.no_grad():
            load_weights(model, iter_safetensors(source.path), source.name)
        if quantization in ("int8", "int4"):
            from backend.quant.hf_quantize import quantize_model

            quantize_model(model, quantization, dtype, source.name)
    else:
        from backend.quant.gguf_load import load_gguf

        load_gguf(model, reader, dtype, source.name, keep_quantized=quantization != "dequantize")
    if device.type == "cpu":
        _pack_for_cpu(model, products, reader if source.gguf_file is not None else None)
    from backend.kernels.rotary import model_cos_sin

    model.cos_sin = model_cos_sin(config, max_positions)  # kept in fp32; cast per batch like the reference does
    _offload(model, moe_gpu_experts, device, moe_cpu_compute)
    return model.to(device).eval()


def _pack_for_cpu(model: CausalLM, products: str, reader) -> None:
    """Repack quantized weights for our CPU kernel, or map a GGUF's earlier repack (backend/quant/pack_cache.py).
    reader: the GGUF file's (its identity and tensor table mark the repack kept), None for other models."""
    from backend.models.mla import pack_head_weights
    from backend.quant import cpu_layout, pack_cache
    from backend.quant.modules import QuantWeight

    pack_head_weights(model)
    if not cpu_layout.enabled():
        return
    entry = pack_cache.entry_path(reader.path, products) if reader is not None else None
    origin = pack_cache.made_from(reader, products) if reader is not None else {}
    if entry is not None and pack_cache.load(model, entry, origin):
        return
    from rich.progress import Progress

    weights = [m for m in model.modules() if isinstance(m, QuantWeight)]
    if entry is not None:
        log.info("repacking %d quantized weights for the CPU kernel (once for this file: kept in %s)", len(weights),
                 entry.parent)
    started = time.monotonic()
    with Progress(transient=True, disable=not sys.stderr.isatty()) as progress:
        task = progress.add_task("repacking weights for the CPU kernel", total=len(weights))
        # torch's ops release the GIL: a weight per core (each op's own threads would mostly sit idle on them)
        with ThreadPoolExecutor(max(1, min(os.cpu_count() or 1, 8))) as pool:
            for _ in pool.map(lambda m: m.pack_for_cpu(products), weights):
                progress.advance(task)
    if entry is not None and pack_cache.save(model, entry, origin):
        log.info("repacked in %.1f s; the next start maps %s", time.monotonic() - started, entry.name)


def _offload(model: CausalLM, slots: int | None, device: torch.device, cpu_compute: bool) -> None:
    if slots is None:
        return
    from backend.models.moe import SparseMoE

    layers = [m for m in model.modules() if isinstance(m, SparseMoE)]
    if not layers:
        raise ValueError("moe_gpu_experts is set but the model has no MoE layers")
    for layer in layers:
        layer.offload(slots, device, cpu_compute)
    if not cpu_compute:
        _link_ahead(model)


def _link_ahead(model: CausalLM) -> None:
    """Each MoE layer that copies experts in guesses the next MoE layer's routing and copies ahead
    (ExpertCache.link_next): the next router on this layer's normed input, with the next norm's weights in place of
    this norm's. An RMSNorm's output is its input's unit vector times the weights, so scaling the next router's
    columns by the ratio of the two norms' weights applies it to the residual as the next norm would see it."""
    from backend.models.expert_cache import ExpertCache

    layers = [layer for layer in model.model.layers if isinstance(getattr(layer.mlp, "expert_cache", None), ExpertCache)]
    for this, after in zip(layers, layers[1:]):
        gate = after.mlp.gate
        if not isinstance(gate, torch.nn.Linear):  # a quantized router: no guess
            continue
        mine, theirs = this.post_attention_layernorm.weight.float(), after.post_attention_layernorm.weight.float()
        ratio = torch.where(mine != 0, theirs / mine, torch.zeros_like(mine))
        guess = (gate.weight.float() * ratio).to(gate.weight.dtype)
        this.mlp.expert_cache.link_next(guess, after.mlp.top_k, after.mlp.expert_cache)


def _auto_tokenizer(path: Path, **kwargs):
    """AutoTokenizer.from_pretrained, handed config.json as a plain config: what it reads of it (model_type,
    tokenizer_class, the name) is there, and the family's own config class is not imported, which would import
    transformers' model-loading stack (2.8 s of every start-up)."""
    from transformers import AutoTokenizer, PreTrainedConfig

    try:
        fields = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        fields = {}
    config = PreTrainedConfig(**({"tokenizer_class": fields["tokenizer_class"]} if fields.get("tokenizer_class") else {}))
    config.model_type = fields.get("model_type", "")
    config._name_or_path = str(path)
    return AutoTokenizer.from_pretrained(str(path), config=config, **kwargs)


def load_tokenizer(source: ModelSource, tokenizer: str | None = None):
    """The model's tokenizer (a GGUF's from its metadata, converted by transformers at its first start and
    read without transformers after: backend.plain_tokenizer), or the one in the directory `tokenizer` names."""

    if tokenizer is not None and resolve(tokenizer) not in (source.path, source.gguf_file):
        path = resolve(tokenizer)
        try:
            return _auto_tokenizer(path)
        except (OSError, ValueError) as e:
            raise ModelLoadError(f"tokenizer {tokenizer}: cannot load it ({e}); give a Hugging Face directory "
                                 "with tokenizer files, or leave tokenizer unset to use the model's own") from None
    if source.random_weights and not any(source.path.glob("tokenizer*")):
        return None  # a random-weight model for benchmarks takes token ids
    if source.gguf_file is None:
        try:
            return _auto_tokenizer(source.path)
        except (OSError, ValueError) as e:
            raise ModelLoadError(f"{source.path}: cannot load its tokenizer ({e})") from None
    # Converting a GGUF vocabulary takes seconds; keep the converted tokenizer under the cache directory.
    stat = source.gguf_file.stat()
    key = hashlib.sha256(f"{source.gguf_file.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    cached = cache_dir() / "tokenizers" / key
    if not (cached / "tokenizer.json").exists():
        from transformers import AutoTokenizer, PreTrainedTokenizerFast

        shutil.rmtree(cached, ignore_errors=True)  # a conversion cut short
        tmp = cached.with_name(f"{cached.name}.{os.getpid()}.partial")
        try:
            converted = AutoTokenizer.from_pretrained(str(source.path), gguf_file=source.gguf_file.name)
        except (ValueError, TypeError):  # a layout transformers reads no config of (smollm3), or misreads
            # (gpt-oss's rope keys: a TypeError in transformers 5's reader): the file's vocabulary alone
            converted = PreTrainedTokenizerFast.from_pretrained(str(source.path), gguf_file=source.gguf_file.name)
        converted.save_pretrained(str(tmp))
        try:
            tmp.replace(cached)
        except OSError:  # another process converted it first
            shutil.rmtree(tmp, ignore_errors=True)
    return PlainTokenizer(cached)
