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
# Small enough to build in a minute on 2 cores, large enough that a decode step streams ~10 MB of experts.
SHAPES = {
    "qwen3_moe": dict(hidden_size=1024, moe_intermediate_size=512, num_experts=16, num_experts_per_tok=8,
                      num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4, head_dim=128,
                      intermediate_size=1024),
    "mixtral": dict(hidden_size=1024, intermediate_size=2048, num_local_experts=4, num_experts_per_tok=2,
                    num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4),
}


def moe_file(family: str) -> Path:
    """The cached Q4_K_M file of SHAPES[family] (written on first use)."""
    from backend.home import cache_dir
    from tests.backend.tiny_gguf import build_family, write_gguf

    shape = SHAPES[family]
    key = hashlib.sha256(json.dumps([family, shape, Q4_K_M], sort_keys=True).encode()).hexdigest()[:12]
    out = cache_dir() / "bench" / f"{family}-{key}-Q4_K_M.gguf"
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
    for name in SHAPES:
        print(moe_file(name))
