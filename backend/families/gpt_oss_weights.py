"""gpt-oss checkpoints' tensors under our names and layouts: the experts' stacks (float, or OpenAI's MXFP4
`*_blocks` / `*_scales`) as [E, 2I, H] gate rows then up rows and [E, H, I], their biases likewise, and the router's
bias. MXFP4 stacks stay MXFP4 (keep_mxfp4: re-encoded into GGML's blocks, which our kernels read, value for value);
weights.load_weights reads the rest as it reads every family's."""

import re
from collections.abc import Collection, Iterator

import torch

from backend.model_config import ModelLoadError

_EXPERTS = re.compile(r"^(.*\.mlp)\.experts\.(gate_up_proj|down_proj)(_blocks|_scales|_bias)?$")
_OURS = {"gate_up_proj": "w_gate_up", "down_proj": "w_down"}
# a gpt-oss GGUF's expert biases (gguf_load names them after llama.cpp's stacks): gate and up apart, [E, I] each, or
# fused as [E, 2I], gate's then up's
_GGUF_BIAS = re.compile(r"^(.*\.mlp)\.ffn_(gate|up|down|gate_up)_exps\.bias$")

# MXFP4 as the OCP Microscaling Formats (MX) Specification v1.0 defines it: blocks of 32 elements (its table 1,
# MXFP4: k = 32) of FP4 E2M1 sharing one E8M0 scale.
# E2M1 (section 5.3.3): a sign bit, 2 exponent bits of bias 1, 1 mantissa bit, no infinities or NaN; the 8
# magnitudes of codes 0-7 (0 and 0.5 subnormal), code + 8 the same negated.
_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# E8M0 (section 5.4.1): an unsigned exponent of bias 127, 2^(e - 127); 0xFF is NaN.
_E8M0_BIAS, _E8M0_NAN = 127, 0xFF
# The packing of OpenAI's checkpoints (as transformers' integrations/mxfp4.py reads them): blocks [..., G, 16]
# bytes, element 2j in byte j's low nibble and 2j + 1 in its high nibble; scales [..., G].


def mxfp4_decode(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """blocks [..., G, 16] uint8 and scales [..., G] uint8 -> fp32 [..., G * 32], exactly (each value has at most
    two significant bits, each scale is a power of two that fp32 holds, subnormal 2^-127 included)."""
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != 16:
        raise ValueError(
            f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)}: expected [..., G, 16] "
            "and [..., G]"
        )
    codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).flatten(-2).long()  # [..., G, 32]
    magnitude = torch.tensor(_E2M1, dtype=torch.float32, device=blocks.device)[codes & 7]
    values = torch.where(codes >= 8, -magnitude, magnitude)
    e = scales.to(torch.int32)
    # the scale's fp32 bits: exponent field e - 127 + 127 = e for e >= 1; 2^-127 is the subnormal 0x00400000
    bits = torch.where(e == 0, torch.full_like(e, 0x00400000), e << 23)
    scale = torch.where(e == _E8M0_NAN, torch.full_like(e, 0x7FC00000), bits).view(torch.float32)
    return (values * scale[..., None]).flatten(-2)


def ggml_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """OpenAI's packing (blocks [..., G, 16], scales [..., G]) -> GGML's MXFP4 blocks [..., G * 17] of the same values:
    each block's E8M0 byte, then element j in byte j's low nibble and element j + 16 in its high nibble (ggml's
    block_mxfp4, whose table holds the E2M1 values doubled beside a halved scale: the same products)."""
    codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).flatten(-2)  # [..., G, 32], in element order
    packed = codes[..., :16] | (codes[..., 16:] << 4)
    return torch.cat([scales[..., None], packed], dim=-1).flatten(-2)


def mxfp4_mlps(names: Collection[str]) -> set[str]:
    """The MoE blocks (model.layers.N.mlp) whose checkpoint holds both of their expert stacks as MXFP4 blocks."""
    blocks = {m.group(1) for name in names if (m := _EXPERTS.match(name)) and m.group(3) == "_blocks"}
    return {mlp for mlp in blocks if all(f"{mlp}.experts.{proj}_blocks" in names for proj in _OURS)}


def keep_mxfp4(model: torch.nn.Module, names: Collection[str], dtype: torch.dtype) -> None:
    """On the meta model: each MoE layer whose checkpoint holds its experts as MXFP4 blocks computes on them as
    stored (QuantExperts in MXFP4, filled by as_ours), not on floats four times their size."""
    from backend.quant.experts import QuantExperts
    from backend.quant.formats import BY_NAME
    from backend.quant.modules import QuantWeight

    mxfp4, kept = BY_NAME["MXFP4"], mxfp4_mlps(names)
    for name, module in model.named_modules():
        if name not in kept:
            continue
        experts, rows, hidden = module.w_gate_up.shape
        gate, up = (QuantWeight(mxfp4, rows // 2, hidden, (experts,), dtype=dtype) for _ in range(2))
        module.use_quantized(
            QuantExperts(gate, up, QuantWeight(mxfp4, hidden, rows // 2, (experts,), dtype=dtype))
        )


def _fill_mxfp4(experts, proj: str, blocks: torch.Tensor, scales: torch.Tensor, source: str) -> None:
    """A pair of OpenAI's MXFP4 tensors into the stacks keep_mxfp4 made (gate_up's interleaved rows parted)."""
    stacked = ggml_mxfp4(blocks, scales)
    pairs = (
        ((experts.gate, stacked[:, 0::2]), (experts.up, stacked[:, 1::2]))
        if proj == "gate_up_proj"
        else ((experts.down, stacked),)
    )
    for weight, data in pairs:
        if tuple(weight.data.shape) != tuple(data.shape):
            raise ModelLoadError(
                f"{source}: MXFP4 experts {proj} of {tuple(blocks.shape)} blocks do not match the "
                f"config's {weight.lead[0]} experts of {weight.rows} x {weight.cols}"
            )
        weight.data.copy_(data)


def _gate_rows_first(t: torch.Tensor, proj: str) -> torch.Tensor:
    """gpt-oss interleaves each expert's gate and up rows (gate 0, up 0, gate 1, ...); ours are gate rows then up."""
    return torch.cat([t[:, 0::2], t[:, 1::2]], dim=1) if proj == "gate_up_proj" else t


def as_ours(
    tensors: Iterator[tuple[str, torch.Tensor]], source: str, model: torch.nn.Module
) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's (name, tensor) pairs with the experts and the router's bias in our names and layouts; MXFP4
    experts that keep_mxfp4 kept are written into the model's stacks here, not yielded."""
    pending: dict[tuple[str, str], dict[str, torch.Tensor]] = {}
    for name, tensor in tensors:
        if name.endswith(".self_attn.sinks.weight"):  # llama.cpp's attn_sinks.weight
            yield name.removesuffix(".weight"), tensor
            continue
        if b := _GGUF_BIAS.match(name):
            mlp, role = b.groups()
            if role in ("down", "gate_up"):
                yield f"{mlp}.w_{role}_bias", tensor
                continue
            halves = pending.setdefault((mlp, "gate_up_bias"), {})
            halves[role] = tensor
            if len(halves) == 2:
                del pending[(mlp, "gate_up_bias")]
                yield f"{mlp}.w_gate_up_bias", torch.cat([halves["gate"], halves["up"]], dim=1)
            continue
        m = _EXPERTS.match(name)
        if m is None:
            yield name.replace(".mlp.router.bias", ".mlp.gate.bias"), tensor
            continue
        mlp, proj, part = m.groups()
        ours = f"{mlp}.{_OURS[proj]}"
        if part == "_bias":
            yield f"{ours}_bias", _gate_rows_first(tensor, proj)
        elif part is None:  # floats as transformers keeps them, [E, in, out]
            yield ours, _gate_rows_first(tensor.transpose(1, 2), proj)
        else:  # MXFP4 rows of [E, out, in / 32, 16], and their scales
            parts = pending.setdefault((mlp, proj), {})
            parts[part] = tensor
            if len(parts) == 2:
                del pending[(mlp, proj)]
                kept = getattr(model.get_submodule(mlp), "experts", None)
                if kept is not None:
                    _fill_mxfp4(kept, proj, parts["_blocks"], parts["_scales"], source)
                else:
                    yield ours, _gate_rows_first(mxfp4_decode(parts["_blocks"], parts["_scales"]), proj)
    if pending:
        missing = ", ".join(_other_half(mlp, proj, p) for (mlp, proj), p in pending.items())
        raise ModelLoadError(f"{source}: experts without their other half: {missing}")


def _other_half(mlp: str, proj: str, parts: dict) -> str:
    if proj == "gate_up_bias":  # a GGUF's
        return f"{mlp}.ffn_{'up' if 'gate' in parts else 'gate'}_exps.bias"
    return f"{mlp}.experts.{proj}{'_scales' if '_blocks' in parts else '_blocks'}"
