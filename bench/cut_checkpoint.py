"""The cut checkpoints the benches run: a published model's widths (bench/published_shapes.json) with fewer layers,
experts or a smaller vocabulary, random weights, written once as a GGUF file under the data directory's cache/bench
and reused; and llama.cpp's Q4_K_M choice of formats for their tensors."""

import contextlib
import hashlib
import json
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

PUBLISHED: dict[str, dict] = json.loads(Path(__file__).with_name("published_shapes.json").read_text())
# tensor kinds by llama.cpp's names (blk.N.<kind>.weight)
ENDS = ("token_embd", "output")
ATTENTION = ("attn_q", "attn_k", "attn_v", "attn_output")
DENSE_MLP = ("ffn_gate", "ffn_up", "ffn_down")
EXPERTS = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")
SHARED_EXPERT = ("ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp")
# llama.cpp's quantizer gives these kinds Q6_K in a Q4_K_M file, every other kind Q4_K
_Q4_K_M_SIX_BIT = ("output", "attn_v", "ffn_down", "ffn_down_exps", "ffn_down_shexp")


def q4_k_m(*kinds: str, **formats: str) -> dict[str, str]:
    """llama.cpp's Q4_K_M format for each tensor kind, and `formats`: the kinds that take another one (rows that
    hold no whole 256-block fall back to Q8_0, as its quantizer does)."""
    return {**{kind: "Q6_K" if kind in _Q4_K_M_SIX_BIT else "Q4_K" for kind in kinds}, **formats}


def shape_key(*parts) -> str:
    """12 hex digits of what a file is built from (its shape, its formats): its cached name changes with them."""
    return hashlib.sha256(json.dumps(list(parts), sort_keys=True).encode()).hexdigest()[:12]


def cached_gguf(name: str, write: Callable[[Path, Path], None]) -> Path:
    """cache/bench/name, written on first use by write(scratch, partial) (a scratch folder for the checkpoint it
    converts, and the file to write) and moved into place only once whole."""
    from backend.home import cache_dir

    out = cache_dir() / "bench" / name
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as scratch:
        partial = Path(scratch) / name
        write(Path(scratch), partial)
        partial.replace(out)
    return out


def random_bf16_checkpoint(model_class, config, directory: Path) -> None:
    """model_class(config) drawn from seed 0, saved in bf16 with the tests' small tokenizer (prompts are ids)."""
    import torch

    from tests.backend.tiny_models import build_tokenizer

    torch.manual_seed(0)
    with torch.no_grad():
        model_class(config).to(torch.bfloat16).save_pretrained(str(directory))
    build_tokenizer(directory)


@contextlib.contextmanager
def bf16_by_default() -> Iterator[None]:
    """torch builds new tensors in bf16 inside: a checkpoint of billions of parameters is drawn without its fp32
    copy."""
    import torch

    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        yield
    finally:
        torch.set_default_dtype(default)
