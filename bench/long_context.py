"""SmolLM2 (the embedded default, trained at 8192 tokens) past its trained length: the mean next-token loss
(nats) over bands of positions of one long text (the Python standard library's sources, concatenated), with YaRN
x4 (what `serve` gives it: 32768 tokens), without scaling (RoPE extrapolated) and with YaRN x8 (65536). One JSON line on stdout; each
run's figures on stderr as they come.

    python bench/long_context.py [--length 32768] [--plain-length 16384] [--quick]
"""

import argparse
import json
import sys
import sysconfig
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from backend import LLM, SamplingParams  # noqa: E402
from backend.kernels.rotary import cos_sin_table  # noqa: E402
from backend.loader import load_tokenizer, locate  # noqa: E402

BANDS = [(0, 8192), (8192, 16384), (16384, 32768), (32768, 65536)]


def stdlib_text(chars: int) -> str:
    """Sorted standard-library modules until `chars` characters: the same text every run."""
    parts, total = [], 0
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        parts.append(path.read_text(errors="replace"))
        total += len(parts[-1])
        if total >= chars:
            break
    return "\n".join(parts)


def token_losses(llm: LLM, ids: list[int]) -> torch.Tensor:
    """-log p(token i+1 | tokens <= i) for every position: the prompt's logprobs, computed through the engine's
    paged cache in the chunks its step budget gives (one step no longer takes a whole long prompt)."""
    out = llm.generate(ids, SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
    return torch.tensor([-entry[token].logprob for token, entry in zip(ids[1:], out.prompt_logprobs[1:])])


def bands(losses: torch.Tensor) -> dict:
    return {f"{lo}-{hi}": round(losses[lo:hi].mean().item(), 4) for lo, hi in BANDS if lo < len(losses)}


def run(name: str, ids: list[int], length: int, unscaled: bool = False, **settings) -> dict:
    started = time.perf_counter()
    llm = LLM(
        "smollm2",
        max_model_len=length,
        max_num_batched_tokens=min(length, 4096),
        max_num_seqs=1,
        num_kv_blocks=length // 16 + 1,
        disk_cache_bytes=0,
        **settings,
    )  # nothing written to the home
    if unscaled:  # the trained RoPE past its length (what `--rope-scaling none` refuses to serve there)
        cfg, model = llm.engine.model_config, llm.engine.model
        model.cos_sin = cos_sin_table(cfg.rotary_dim, cfg.rope_theta, None, length).to(model.cos_sin.dtype)
    row = {
        "run": name,
        "tokens": length,
        **bands(token_losses(llm, ids[: length - 1])),
        "seconds": round(time.perf_counter() - started),
    }
    print(json.dumps(row), file=sys.stderr, flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--length", type=int, default=32768, help="tokens of the YaRN x4 run")
    parser.add_argument("--plain-length", type=int, default=16384, help="tokens of the run without scaling")
    parser.add_argument(
        "--x8-length",
        type=int,
        default=16384,
        help="tokens of a YaRN x8 run (what --max-model-len 65536 gives), for its cost at short range",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="9,216 tokens for every run (just past the trained length): a smoke run of minutes",
    )
    args = parser.parse_args()
    if args.quick:
        args.length = args.plain_length = args.x8_length = 9216
    ids = load_tokenizer(locate("smollm2"))(
        stdlib_text(6 * max(args.length, args.plain_length, args.x8_length))
    )["input_ids"]
    assert len(ids) >= max(args.length, args.plain_length, args.x8_length), "not enough text"
    rows = [
        run("yarn_x4", ids, args.length, rope_scaling="yarn:4"),
        run("none", ids, args.plain_length, unscaled=True, rope_scaling="yarn:4"),
        run("yarn_x8", ids, args.x8_length, rope_scaling="yarn:8"),
    ]
    print(
        json.dumps(
            {
                "model": "smollm2 (SmolLM2-135M-Instruct Q4_1, trained at 8192)",
                "text": "Python stdlib sources",
                "mean_loss_nats": rows,
            }
        )
    )


if __name__ == "__main__":
    main()
