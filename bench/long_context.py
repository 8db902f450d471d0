"""SmolLM2 (the embedded default, trained at 8192 tokens) past its trained length: the mean next-token loss
(nats) over bands of positions of one long text (the Python standard library's sources, concatenated), with YaRN
x4 (what `serve` gives it: 32768 tokens), without scaling (RoPE extrapolated) and with YaRN x8 (65536). One JSON line on stdout; each
run's figures on stderr as they come.

    python bench/long_context.py [--length 32768] [--plain-length 16384]
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


def token_losses(llm: LLM, ids: list[int], unscaled: bool = False) -> torch.Tensor:
    """-log p(token i+1 | tokens <= i) for every position, from one prefill through the engine's paged cache."""
    engine = llm.engine
    if unscaled:  # the trained RoPE past its length: what serving without scaling would compute
        cfg = engine.model_config
        engine.model.cos_sin = cos_sin_table(cfg.rotary_dim, cfg.rope_theta, None, engine.max_model_len)
    engine.add_request("long", ids, SamplingParams(max_tokens=1))
    batch = engine.scheduler.schedule()
    assert [item.num_scheduled_tokens for item in batch] == [len(ids)], "the prompt must fit one step"
    input_ids, positions, meta, inputs = engine.runner.prepare(batch)
    target = torch.tensor(ids[1:])
    losses = []
    with torch.inference_mode():
        hidden = engine.model(input_ids, positions, meta)[inputs.hidden_rows[0]]
        for start in range(0, len(ids) - 1, 1024):
            logits = engine.model.compute_logits(hidden[start:min(start + 1024, len(ids) - 1)]).float()
            losses.append(torch.nn.functional.cross_entropy(logits, target[start:start + len(logits)],
                                                            reduction="none"))
    engine.abort_request("long")
    return torch.cat(losses)


def bands(losses: torch.Tensor) -> dict:
    return {f"{lo}-{hi}": round(losses[lo:hi].mean().item(), 4) for lo, hi in BANDS if lo < len(losses)}


def run(name: str, ids: list[int], length: int, **settings) -> dict:
    unscaled = settings.pop("unscaled", False)
    started = time.perf_counter()
    llm = LLM("smollm2", max_model_len=length, max_num_batched_tokens=length, max_num_seqs=1,
              num_kv_blocks=length // 16 + 1, **settings)
    row = {"run": name, "tokens": length, **bands(token_losses(llm, ids[:length - 1], unscaled)),
           "seconds": round(time.perf_counter() - started)}
    print(json.dumps(row), file=sys.stderr, flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--length", type=int, default=32768, help="tokens of the YaRN x4 run")
    parser.add_argument("--plain-length", type=int, default=16384, help="tokens of the run without scaling")
    parser.add_argument("--x8-length", type=int, default=16384,
                        help="tokens of a YaRN x8 run (what --max-model-len 65536 gives), for its cost at short range")
    args = parser.parse_args()
    ids = load_tokenizer(locate("smollm2"))(stdlib_text(6 * max(args.length, args.plain_length, args.x8_length)))["input_ids"]
    assert len(ids) >= max(args.length, args.plain_length, args.x8_length), "not enough text"
    rows = [run("yarn_x4", ids, args.length, rope_scaling="yarn:4"),
            run("none", ids, args.plain_length, rope_scaling="yarn:4", unscaled=True),
            run("yarn_x8", ids, args.x8_length, rope_scaling="yarn:8")]
    print(json.dumps({"model": "smollm2 (SmolLM2-135M-Instruct Q4_1, trained at 8192)",
                      "text": "Python stdlib sources", "mean_loss_nats": rows}))


if __name__ == "__main__":
    main()
