"""The MoE source file of bench/iq_formats.py: Qwen3-30B-A3B's layer shapes (hidden 2048, experts of 768, top-8 routing,
32 query and 4 key/value heads of 128) cut to fewer layers and 32 of its 128 experts, so that it builds in a few minutes
on a small machine; random weights written in llama.cpp's qwen3moe layout by the tests' copy of its converter
(tests/backend/tiny_gguf.py), every matrix Q8_0, for llama.cpp's quantizer to requantize into the mixes.

Cached under the data directory's cache/bench, keyed by the shape. python bench/iq_moe_file.py [LAYERS] prints the path.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.cut_checkpoint import ATTENTION, ENDS, EXPERTS, PUBLISHED, cached_gguf, shape_key  # noqa: E402

EXPERTS_KEPT = 32  # of Qwen3-30B-A3B's 128
SOURCE_POLICY = {kind: "Q8_0" for kind in (*ENDS, *ATTENTION, *EXPERTS)}


def qwen3_30b_a3b_cut(layers: int) -> Path:
    """The cached Q8_0 file of the shape with this many layers (written on first use)."""
    from tests.backend.tiny_gguf import build_family, write_gguf

    shape = dict(PUBLISHED["qwen3-30b-a3b"], num_experts=EXPERTS_KEPT, num_hidden_layers=layers)
    key = shape_key(shape, SOURCE_POLICY)

    def write(scratch: Path, partial: Path) -> None:
        hf = build_family("qwen3_moe", scratch / "hf", **shape)
        write_gguf("qwen3_moe", hf, partial, policy=SOURCE_POLICY)

    return cached_gguf(f"qwen3-30b-a3b-shaped-{layers}l-{EXPERTS_KEPT}e-{key}-Q8_0.gguf", write)


if __name__ == "__main__":
    print(qwen3_30b_a3b_cut(int(sys.argv[1]) if len(sys.argv) > 1 else 4))
