"""Run inside a private mount namespace (`unshare -m`, or `unshare -rm` without root): the packed-weights cache on a
4 MiB tmpfs. A first load of the GGUF file repacks and keeps its entry; the entry is then cut to half and the tmpfs
remounted read-only, and the file loaded again; then the tmpfs is made writable, emptied and filled to its last
byte, and the file loaded again. Prints each load's outputs, the warnings it logged and the files the cache held
after it, or the error that failed it, as one JSON document. The namespace takes the mount away when this process
ends, whatever happens in it.

Run: python -m tests.backend.pack_cache_mounts FILE.gguf CACHE_DIR"""

import json
import logging
import subprocess
import sys
from pathlib import Path

from tests.reliability.full_disk import MOUNT_FAILED, fill

PROMPTS = [[(i * 37 + n * 11) % 397 + 3 for i in range(n)] for n in (5, 30)]  # conftest.prompts_of_lengths's


class Warnings(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def load(gguf: Path, cache: Path) -> dict:
    from backend import LLM, SamplingParams

    caught = Warnings()
    logging.getLogger("backend.quant.pack_cache").addHandler(caught)
    try:
        params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=3)
        done = LLM(str(gguf), block_size=16).generate(PROMPTS, params, use_tqdm=False)
        out = {
            "outputs": [
                [
                    o.outputs[0].token_ids,
                    [{str(k): v.logprob for k, v in step.items()} for step in o.outputs[0].logprobs],
                ]
                for o in done
            ]
        }
    except Exception as e:  # noqa: BLE001 what the test reports: the load this cache must never fail
        out = {"error": f"{type(e).__name__}: {e}"}
    finally:
        logging.getLogger("backend.quant.pack_cache").removeHandler(caught)
    packed = cache / "packed"
    return {
        **out,
        "warnings": caught.lines,
        "files": sorted(p.name for p in packed.iterdir()) if packed.is_dir() else [],
    }


def main(gguf: Path, cache: Path) -> dict:
    from backend.quant import pack_cache

    cache.mkdir(parents=True, exist_ok=True)
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(cache)]).returncode != 0:
        sys.exit(MOUNT_FAILED)
    pack_cache.cache_dir = lambda: cache
    out = {"first": load(gguf, cache)}
    entry = pack_cache.entry_path(gguf, "float32")
    whole = entry.read_bytes()
    entry.write_bytes(whole[: len(whole) // 2])  # a write cut short, left behind on a disk now read-only
    subprocess.run(["mount", "-o", "remount,ro", str(cache)], check=True)
    out["read_only"] = {**load(gguf, cache), "entry_size_after": entry.stat().st_size}
    subprocess.run(["mount", "-o", "remount,rw", str(cache)], check=True)
    entry.unlink()
    fill(cache)
    out["full"] = load(gguf, cache)
    return out


if __name__ == "__main__":
    print(json.dumps(main(Path(sys.argv[1]), Path(sys.argv[2]))))
