"""Prompts kept across restarts (backend/engine/disk_prefix_cache.py): a ~4,000-token prompt's time to first token
on SmolLM2 (the embedded default) cold, then in a restarted engine with the disk prefix cache, then in one without
it. The KV blocks go to a temporary SCRIPTORIUM_HOME, so the user's cache is left as it was. One JSON line on
stdout.

    python bench/disk_prefix_cache.py [--tokens 4000]
"""

import argparse
import json
import os
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from backend import LLM, SamplingParams  # noqa: E402
from backend.loader import load_tokenizer, locate  # noqa: E402
from backend.model_store import pull  # noqa: E402

FIRST_TOKEN = SamplingParams(temperature=0, max_tokens=1)


def prompt_ids(model: Path, tokens: int) -> list[int]:
    """The first `tokens` tokens of the standard library's sorted sources: the same prompt every run."""
    text, total = [], 0
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        text.append(path.read_text(errors="replace"))
        total += len(text[-1])
        if total >= tokens * 6:
            break
    return load_tokenizer(locate(str(model))).encode("\n".join(text))[:tokens]


def first_token(llm: LLM, ids: list[int]) -> tuple[float, int]:
    started = time.perf_counter()
    out = llm.generate(ids, FIRST_TOKEN, use_tqdm=False)[0]
    return time.perf_counter() - started, out.num_cached_tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=4000)
    args = parser.parse_args()
    model = pull("smollm2", quiet=True)  # from the real home, before the temporary one is set
    ids = prompt_ids(model, args.tokens)
    with tempfile.TemporaryDirectory() as home:
        os.environ["SCRIPTORIUM_HOME"] = home
        cold = LLM(str(model))
        cold_s, _ = first_token(cold, ids)
        started = time.perf_counter()
        cold.engine.disk_cache.flush()
        write_s = time.perf_counter() - started  # after the request, on the writer's thread
        written = sum(f.stat().st_size for f in Path(home, "cache", "kv").rglob("*.kv"))
        del cold
        disk_s, from_disk = first_token(LLM(str(model)), ids)
        plain_s, from_memory = first_token(LLM(str(model), disk_cache_bytes=0), ids)
    print(
        json.dumps(
            {
                "bench": "disk_prefix_cache",
                "model": model.name,
                "prompt_tokens": len(ids),
                "cold_ttft_s": round(cold_s, 3),
                "restart_disk_ttft_s": round(disk_s, 3),
                "restart_disk_cached_tokens": from_disk,
                "restart_no_disk_ttft_s": round(plain_s, 3),
                "restart_no_disk_cached_tokens": from_memory,
                "written_mb": round(written / 1e6, 1),
                "write_drain_after_request_s": round(write_s, 3),
            }
        )
    )


if __name__ == "__main__":
    main()
