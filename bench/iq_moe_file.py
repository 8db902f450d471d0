"""The MoE source file of bench/iq_formats.py: Qwen3-30B-A3B's layer shapes (hidden 2048, experts of 768, top-8 routing,
32 query and 4 key/value heads of 128) cut to fewer layers and 32 of its 128 experts, so that it builds in a few minutes
on a small machine; random weights written in llama.cpp's qwen3moe layout by the tests' copy of its converter
(tests/backend/tiny_gguf.py), every matrix Q8_0, for llama.cpp's quantizer to requantize into the mixes.

Cached under the data directory's cache/bench, keyed by the shape. python bench/iq_moe_file.py [LAYERS] prints the path.
"""

import hashlib
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

# Qwen3-30B-A3B's config.json, but for num_hidden_layers (48 there) and num_experts (128)
QWEN3_30B_A3B_LAYER = dict(
    hidden_size=2048,
    moe_intermediate_size=768,
    num_experts_per_tok=8,
    num_attention_heads=32,
    num_key_value_heads=4,
    head_dim=128,
    intermediate_size=6144,
)
EXPERTS = 32
SOURCE_POLICY = {
    kind: "Q8_0"
    for kind in (
        "token_embd",
        "output",
        "attn_q",
        "attn_k",
        "attn_v",
        "attn_output",
        "ffn_gate_exps",
        "ffn_up_exps",
        "ffn_down_exps",
    )
}


def qwen3_30b_a3b_cut(layers: int) -> Path:
    """The cached Q8_0 file of the shape with this many layers (written on first use)."""
    from backend.home import cache_dir
    from tests.backend.tiny_gguf import build_family, write_gguf

    shape = dict(QWEN3_30B_A3B_LAYER, num_experts=EXPERTS, num_hidden_layers=layers)
    key = hashlib.sha256(json.dumps([shape, SOURCE_POLICY], sort_keys=True).encode()).hexdigest()[:12]
    out = cache_dir() / "bench" / f"qwen3-30b-a3b-shaped-{layers}l-{EXPERTS}e-{key}-Q8_0.gguf"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as root:
        hf = build_family("qwen3_moe", Path(root) / "hf", **shape)
        partial = Path(root) / out.name
        write_gguf("qwen3_moe", hf, partial, policy=SOURCE_POLICY)
        partial.replace(out)
    return out


if __name__ == "__main__":
    print(qwen3_30b_a3b_cut(int(sys.argv[1]) if len(sys.argv) > 1 else 4))
