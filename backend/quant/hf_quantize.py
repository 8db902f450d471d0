"""Weight-only, group-wise quantization of a Hugging Face checkpoint at load (quantization="int8" | "int4").

Each linear layer of the decoder (attention, MLP, shared and routed experts) is written into GGUF blocks, so
the layers, kernels and CPU repacking of GGUF files run it unchanged: int8 is Q8_0 (a symmetric fp16 scale
per 32 weights), int4 is Q4_1 (an fp16 scale and minimum per 32 weights: asymmetric, which halves the error
of a symmetric 4-bit grid on weights that are not centred). The embeddings, the output layer and the routers
keep the checkpoint's dtype, as GPTQ/AWQ checkpoints do: they are where rounding costs the most quality.
"""

import logging
from collections.abc import Callable

import torch
from torch import nn

from backend.quant.experts import QuantExperts
from backend.quant.formats import BY_NAME, Format
from backend.quant.modules import QuantLinear, QuantWeight

log = logging.getLogger("backend.quant")

MODES = {"int8": "Q8_0", "int4": "Q4_1"}
GROUP = 32
# Linear layers that keep the checkpoint's dtype: routers (a few rows that decide every expert) and the output;
# DeepSeek's kv_b_proj, which the latent attention reads as a float matrix (models/mla.py).
KEEP = ("mlp.gate", "mlp.shared_expert_gate", "lm_head", "self_attn.kv_b_proj")


def _f16_bytes(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.float16).contiguous().view(torch.uint8).view(*x.shape, 2)


def quantize_blocks(w: torch.Tensor, fmt: Format) -> torch.Tensor:
    """Weights [..., rows, cols] (cols a multiple of 32) -> blocks [..., rows, row_bytes] uint8."""
    lead, cols = w.shape[:-1], w.shape[-1]
    g = w.detach().float().reshape(-1, GROUP)
    # Both round against the scale (and minimum) as stored in fp16, so the integers fit what decoding reads.
    if fmt.name == "Q8_0":
        d16 = (g.abs().amax(dim=1) / 127).to(torch.float16).float()
        q = torch.round(g / torch.where(d16 > 0, d16, 1)[:, None]).clamp_(-127, 127).to(torch.int8)
        blocks = torch.cat([_f16_bytes(d16), q.view(torch.uint8)], dim=1)
    elif fmt.name == "Q4_1":
        lo, hi = g.amin(dim=1), g.amax(dim=1)
        d = (hi - lo) / 15
        d16, lo16 = d.to(torch.float16).float(), lo.to(torch.float16).float()
        q = torch.round((g - lo16[:, None]) / torch.where(d16 > 0, d16, 1)[:, None]).clamp_(0, 15).to(torch.uint8)
        nibbles = q[:, :16] | (q[:, 16:] << 4)  # weights 0..15 in the low nibbles, 16..31 in the high ones
        blocks = torch.cat([_f16_bytes(d16), _f16_bytes(lo16), nibbles], dim=1)
    else:
        raise ValueError(f"no quantizer for {fmt.name}")
    return blocks.reshape(*lead, cols // GROUP * fmt.block_bytes)


def _weight(w: torch.Tensor, fmt: Format, dtype: torch.dtype) -> QuantWeight:
    *lead, rows, cols = w.shape
    out = QuantWeight(fmt, rows, cols, tuple(lead), dtype=dtype, device="cpu")
    out.data.copy_(quantize_blocks(w, fmt))
    return out


def replace_layers(model: nn.Module, make: Callable[[torch.Tensor], QuantWeight], block: int) -> list[str]:
    """Swap the decoder's linear layers and experts for quantized ones whose weights `make` builds from the float
    weight (a real one, or a meta one for its shape); returns the layers kept because rows are not whole blocks."""
    from backend.models.moe import SparseMoE

    kept = []
    for name, module in list(model.named_modules()):
        if isinstance(module, SparseMoE) and module.experts is None and module.expert_cache is None:
            inter = module.w_gate_up.shape[1] // 2
            if module.w_gate_up.shape[2] % block or module.w_down.shape[2] % block:
                kept.append(f"{name}.experts")
                continue
            stacks = (module.w_gate_up.data[:, :inter], module.w_gate_up.data[:, inter:], module.w_down.data)
            module.use_quantized(QuantExperts(*(make(s) for s in stacks)))
        elif isinstance(module, nn.Linear) and not name.endswith(KEEP):
            if module.in_features % block:
                kept.append(name)
                continue
            new = QuantLinear(module.in_features, [make(module.weight)], bias=False, dtype=module.weight.dtype)
            new.bias = module.bias
            parent, _, attr = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, attr, new)
    return kept


def quantize_model(model: nn.Module, mode: str, dtype: torch.dtype, source: str) -> None:
    """Replace the decoder's linear layers and experts of a loaded (CPU) model with quantized ones, in place."""
    fmt = BY_NAME[MODES[mode]]
    kept = replace_layers(model, lambda w: _weight(w, fmt, dtype), GROUP)
    if kept:
        log.info("%s: %d layer(s) whose rows are not whole groups of %d stay in %s (%s%s)", source, len(kept), GROUP,
                 str(dtype).removeprefix("torch."), ", ".join(kept[:4]), ", ..." if len(kept) > 4 else "")
