"""Q4_K_M GGUF files of a Qwen3-MoE and a Mixtral shape from random weights, laid out as llama.cpp's converter
lays them out (tests/backend/tiny_gguf.py writes them), so our engine and llama.cpp read the very same file.

Q4_K_M as llama.cpp's quantizer picks it: Q4_K everywhere, Q6_K for attn_v, ffn_down(_exps) and the output layer.
Cached under the data directory's cache/bench, keyed by the shape.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.cut_checkpoint import ATTENTION, ENDS, EXPERTS, PUBLISHED, cached_gguf, q4_k_m, shape_key  # noqa: E402

Q4_K_M = q4_k_m(*ENDS, *ATTENTION, *EXPERTS)
# name: (family, shape). The first two: small enough to build in a minute on 2 cores, large enough that a decode
# step streams ~10 MB of experts (the default rows). The third: Qwen3-30B-A3B's layer shapes (hidden 2048, 32 of
# its 128 experts of 768, top-8) in 8 layers, ~0.8 GB, for --shapes (a few minutes and ~10 GB of memory to build).
SHAPES = {
    "qwen3_moe": ("qwen3_moe", dict(hidden_size=1024, moe_intermediate_size=512, num_experts=16,
                                    num_experts_per_tok=8, num_hidden_layers=4, num_attention_heads=8,
                                    num_key_value_heads=4, head_dim=128, intermediate_size=1024)),
    "mixtral": ("mixtral", dict(hidden_size=1024, intermediate_size=2048, num_local_experts=4, num_experts_per_tok=2,
                                num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4)),
    "qwen3_30b_a3b_shaped": ("qwen3_moe", dict(PUBLISHED["qwen3-30b-a3b"], num_experts=32, num_hidden_layers=8)),
}
DEFAULT_SHAPES = ("qwen3_moe", "mixtral")


def moe_file(name: str) -> Path:
    """The cached Q4_K_M file of SHAPES[name] (written on first use)."""
    from tests.backend.tiny_gguf import build_family, write_gguf

    family, shape = SHAPES[name]

    def write(scratch: Path, partial: Path) -> None:
        hf = build_family(family, scratch / "hf", **shape)
        write_gguf(family, hf, partial, policy=Q4_K_M)

    return cached_gguf(f"{name}-{shape_key(family, shape, Q4_K_M)}-Q4_K_M.gguf", write)


if __name__ == "__main__":
    for name in sys.argv[1:] or DEFAULT_SHAPES:
        print(moe_file(name))
