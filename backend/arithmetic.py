"""The engine's arithmetic, chosen once from its settings and the model file: the compute dtype, the KV cache's
dtype, and what the CPU's quantized matmuls multiply."""

import os

import torch

from backend.config import ACTIVATIONS, KV_CACHE_DTYPES

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
    # The CPU path has no fp16 kernels; the CUDA path run on the CPU for tests (SCRIPTORIUM_TRITON=1) has them.
    if device.type == "cpu" and chosen == torch.float16 and os.environ.get("SCRIPTORIUM_TRITON") != "1":
        raise ValueError("dtype float16 is not supported on the CPU; use float32 or bfloat16")
    if device.type == "cuda" and chosen == torch.bfloat16 and not torch.cuda.is_bf16_supported():
        raise ValueError(f"{torch.cuda.get_device_name(device)} cannot run bfloat16; use dtype float16")
    if chosen not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"dtype {chosen} is not supported; use float32, bfloat16 or float16")
    return chosen


def pick_kv_dtype(kv_cache_dtype: str, device: torch.device, dtype: torch.dtype) -> torch.dtype:
    """The KV cache's dtype: the model's ("auto"), or on the CPU float16 / bfloat16 for a float32 engine, which
    halves the cache (twice the tokens in the same memory) and what decode attention reads a step (llama.cpp's
    default is an f16 cache). Keys and values are rounded once, when stored; the arithmetic stays fp32."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype {kv_cache_dtype!r} is not supported; use {', '.join(KV_CACHE_DTYPES)}")
    if kv_cache_dtype == "auto":
        return dtype
    model_dtype = str(dtype).removeprefix("torch.")
    if device.type != "cpu":
        raise ValueError(f"kv_cache_dtype={kv_cache_dtype} is for the CPU; on {device.type} the KV cache takes the "
                         f"model's dtype ({model_dtype}): leave kv_cache_dtype as auto")
    if dtype != torch.float32:
        raise ValueError(f"kv_cache_dtype={kv_cache_dtype} is for a float32 engine; this one runs in {model_dtype}, "
                         "whose KV cache is already 16-bit: leave kv_cache_dtype as auto")
    return DTYPES[kv_cache_dtype]


def products(dtype: torch.dtype, device: torch.device, reader, quantization: str | None, activations: str,
             model: str) -> str:
    """What the CPU's quantized matmuls multiply: "float32", "bfloat16" or "int8" (QuantWeight.pack_for_cpu).

    All but "float32" are for a GGUF whose layers stay in their blocks (some of them: not an F16/BF16 file, nor one
    expanded at load by quantization='dequantize'), which our C kernels run (all of a step in one call, which needs
    fp32 around the matmuls). "int8" (activations="int8"): each row of x quantized per group of 16 or 32 to 8 bits,
    codes times those integers summed in int32 (cpu_int8.c), as llama.cpp does on the CPU: no longer exact against
    transformers, and 2-3x the fp32 kernel's speed with AVX-512 VNNI; a row's bits do not depend on the rows beside
    it, so speculation stays identical to plain decoding. "bfloat16" (dtype bfloat16): where the CPU has AMX the
    codes are stored in the tiles' order and every product is bf16's: up to 16 rows fed the codes themselves (faster
    than fp32 from one row, and a draft's verification row nearly free), more from bf16-rounded weights (2.7x fp32
    at 32 rows); a lone sequence's speculation of up to 15 drafts a step stays identical to its plain decoding.
    Without AMX every product is fp32. Elsewhere bfloat16 is bfloat16 modules, run by PyTorch."""
    from backend.quant import cpu_layout
    from backend.quant.formats import FORMATS

    if activations not in ACTIVATIONS:
        raise ValueError(f"activations {activations!r} is not supported; use {' or '.join(ACTIVATIONS)}")
    blocks = (reader is not None and quantization != "dequantize"
              and any(int(t.tensor_type) in FORMATS and not t.name.endswith(".bias") for t in reader.tensors))
    if activations == "int8":
        if device.type != "cpu":
            raise ValueError(f"activations='int8' is for the CPU's kernels; on {device.type} leave activations as "
                             "float32")
        if dtype != torch.float32:
            name = str(dtype).removeprefix("torch.")
            raise ValueError(f"activations='int8' runs fp32 around the matmuls; dtype {name} cannot go with it: "
                             "leave dtype as auto (or float32)")
        if not blocks:
            what = ("its weights are expanded at load (quantization='dequantize')" if quantization == "dequantize"
                    else "it has no GGUF blocks of a quantized type (Q4_0 .. Q8_0, the K-quants, the IQ types, "
                    "TQ1_0/TQ2_0 or MXFP4)")
            raise ValueError(f"activations='int8' multiplies a GGUF's quantized blocks, and {model}: {what}; leave "
                             "activations as float32")
        if not cpu_layout.enabled():
            raise ValueError("activations='int8' runs in our C kernels, which are not available here (no C "
                             "compiler, or SCRIPTORIUM_QUANT_CPU=reference); leave activations as float32")
        return "int8"
    if device.type == "cpu" and dtype == torch.bfloat16 and blocks and cpu_layout.enabled():
        return "bfloat16"
    return "float32"
