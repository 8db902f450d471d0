"""Q4_K_M GGUF files of a Qwen3-MoE and a Mixtral shape from random weights, laid out as llama.cpp's converter
lays them out (tests/backend/tiny_gguf.py writes them), so our engine and llama.cpp read the very same file.

Q4_K_M as llama.cpp's quantizer picks it: Q4_K everywhere, Q6_K for attn_v, ffn_down(_exps) and the output layer.
Cached under the data directory's cache/bench, keyed by the shape.
"""

import hashlib
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

Q4_K_M = {"token_embd": "Q4_K", "output": "Q6_K", "attn_q": "Q4_K", "attn_k": "Q4_K", "attn_v": "Q6_K",
          "attn_output": "Q4_K", "ffn_gate_exps": "Q4_K", "ffn_up_exps": "Q4_K", "ffn_down_exps": "Q6_K"}
# name: (family, shape). The first two: small enough to build in a minute on 2 cores, large enough that a decode
# step streams ~10 MB of experts (the default rows). The third: Qwen3-30B-A3B's layer shapes (hidden 2048, 32 of
# its 128 experts of 768, top-8) in 8 layers, ~0.8 GB, for --shapes (a few minutes and ~10 GB of memory to build).
SHAPES = {
    "qwen3_moe": ("qwen3_moe", dict(hidden_size=1024, moe_intermediate_size=512, num_experts=16,
                                    num_experts_per_tok=8, num_hidden_layers=4, num_attention_heads=8,
                                    num_key_value_heads=4, head_dim=128, intermediate_size=1024)),
    "mixtral": ("mixtral", dict(hidden_size=1024, intermediate_size=2048, num_local_experts=4, num_experts_per_tok=2,
                                num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4)),
    "qwen3_30b_a3b_shaped": ("qwen3_moe", dict(hidden_size=2048, moe_intermediate_size=768, num_experts=32,
                                               num_experts_per_tok=8, num_hidden_layers=8, num_attention_heads=32,
                                               num_key_value_heads=4, head_dim=128, intermediate_size=6144)),
}
DEFAULT_SHAPES = ("qwen3_moe", "mixtral")


def moe_file(name: str) -> Path:
    """The cached Q4_K_M file of SHAPES[name] (written on first use)."""
    from backend.home import cache_dir
    from tests.backend.tiny_gguf import build_family, write_gguf

    family, shape = SHAPES[name]
    key = hashlib.sha256(json.dumps([family, shape, Q4_K_M], sort_keys=True).encode()).hexdigest()[:12]
    out = cache_dir() / "bench" / f"{name}-{key}-Q4_K_M.gguf"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as root:
        hf = build_family(family, Path(root) / "hf", **shape)
        partial = Path(root) / out.name
        write_gguf(family, hf, partial, policy=Q4_K_M)
        partial.replace(out)
    return out


if __name__ == "__main__":
    for name in sys.argv[1:] or DEFAULT_SHAPES:
        print(moe_file(name))
