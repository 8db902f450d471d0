"""A GGUF file's MoE expert tensors (gguf_load.py reads the rest): which expert stack and rows each tensor holds,
and the QuantExperts a layer's stacks become when the file keeps them quantized.

The layouts llama.cpp's converter writes: gate, up and down as stacks [E, rows, cols] (`ffn_gate_exps`, ...); the
fused `ffn_gate_up_exps` [E, 2I, H] whose first I rows of each expert are gate's and the next I up's (its
`fuse_gate_up_exps` option; llama.cpp's graph takes the two halves as gate and up), read here as two parts of one
tensor; and older Mixtral files' one tensor per expert (`ffn_gate.3`).
"""

import re

from backend.model_config import ModelLoadError
from backend.quant.experts import QuantExperts
from backend.quant.modules import QuantWeight

EXPERT_ROLE = {"ffn_gate": 0, "ffn_up": 1, "ffn_down": 2}
_LEGACY = re.compile(r"^(ffn_gate|ffn_up|ffn_down)\.(\d+)$")
FUSED_GATE_UP = "ffn_gate_up_exps"


def expert_parts(
    tensor, kind: str, suffix: str, source: str
) -> list[tuple[int, int | None, tuple[int, int] | None]]:
    """(role, expert, rows) of each expert stack part this tensor holds: role 0 gate, 1 up, 2 down; expert for the
    older per-expert tensors; rows the part's rows of a fused tensor; none where the tensor is not an expert weight
    (gpt-oss's expert biases are floats beside them)."""
    if m := _LEGACY.match(kind):
        return [(EXPERT_ROLE[m.group(1)], int(m.group(2)), None)]
    if suffix != "weight":
        return []
    if kind == FUSED_GATE_UP:
        rows = int(tensor.shape[1])  # ggml's order: cols, rows, experts
        if rows % 2:
            raise ModelLoadError(
                f"{source}: GGUF tensor {tensor.name!r} holds {rows} rows: gate's and up's halves need an even number"
            )
        return [(0, None, (0, rows // 2)), (1, None, (rows // 2, rows))]
    if kind.endswith("_exps") and kind[:-5] in EXPERT_ROLE:
        return [(EXPERT_ROLE[kind[:-5]], None, None)]
    return []


def quant_experts(roles: dict, quantized, dtype, source: str, module: str, targets: dict) -> QuantExperts:
    """The QuantExperts of one layer's expert entries (by role), each entry's target recorded for the filling:
    id(entry) -> (its weight, first row, expert)."""
    weights = []
    for role in (0, 1, 2):
        es = roles.get(role)
        if not es:
            raise ModelLoadError(
                f"{source}: {module} has expert tensors but none for "
                f"{['ffn_gate', 'ffn_up', 'ffn_down'][role]}"
            )
        # One stacked tensor [E, rows, ..], or (older files) one tensor per expert
        lead = (int(es[0].tensor.shape[2]),) if es[0].expert is None else (len(es),)
        w = QuantWeight(es[0].fmt if quantized(es[0]) else None, *es[0].rows_cols, lead, dtype=dtype)
        for e in es:
            targets[id(e)] = (w, 0, e.expert)
        weights.append(w)
    return QuantExperts(*weights)
