"""The burdens bench/interactive_load.py runs beside a stream, one at a time, and the probes it sends meanwhile.

Each burden is a function of the server's url that returns when the burden is done, with what it is worth
recording (statuses, sizes). The requests name their client (OpenAI's `user`), so that the server's turns by
client (engine/wait_queue.py) count the burden, the stream and the probe as the three clients they stand for.
"""

import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import httpx

SENTENCE = "The scribe copied the manuscript line by line, and the abbot read every page. "  # ~17 tokens
SENTENCE_TOKENS = 17


@dataclass(frozen=True)
class Sizes:
    long_tokens: int = 30000  # the long prompt
    embed_inputs: int = 8
    embed_tokens: int = 1500  # a input
    schema_patterns: int = 400  # properties of each slow schema, a pattern each
    prompts: int = 128  # of the one completion
    prompt_new_tokens: int = 64  # what each of them generates
    competing_s: float = 20.0  # how long the CPU-bound processes run


QUICK = Sizes(long_tokens=4000, embed_tokens=400, schema_patterns=120, prompt_new_tokens=8, competing_s=8.0)


def _post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{url}{path}", json={"model": "smol", **body}, timeout=3600)


def first_token(url: str) -> float:
    """Seconds a new one-token request of its own client waits for its answer."""
    start = time.monotonic()
    _post(
        url, "/v1/completions", {"prompt": f"{time.time()} Ink is", "max_tokens": 1, "user": "probe"}
    ).raise_for_status()
    return time.monotonic() - start


def small_schema(url: str) -> dict:
    """A one-property schema's request (the issue's: refused after 43 s beside two slow ones; 0.42 s alone)."""
    schema = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}
    start = time.monotonic()
    r = _post(
        url,
        "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": "Answer in JSON."}],
            "max_tokens": 4,
            "user": "probe-schema",
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
        },
    )
    return {"small_schema_s": round(time.monotonic() - start, 3), "small_schema_status": r.status_code}


def slow_schema(seed: int, patterns: int) -> dict:
    """A schema of `patterns` string properties with their own regular expressions: seconds to compile."""
    return {
        "type": "object",
        "properties": {
            f"p{k}": {
                "type": "string",
                "pattern": f"^([a-z]{{1,{seed + 8}}}-){{0,20}}[0-9]{{2,{k % 7 + 9}}}$",
            }
            for k in range(patterns)
        },
    }


def burdens(sizes: Sizes) -> dict[str, Callable[[str], dict]]:
    def long_prompt(url: str) -> dict:
        text = f"{time.time()} " + SENTENCE * (sizes.long_tokens // SENTENCE_TOKENS)
        r = _post(url, "/v1/completions", {"prompt": text, "max_tokens": 1, "user": "burden"})
        r.raise_for_status()
        return {"prompt_tokens": r.json()["usage"]["prompt_tokens"]}

    def embeddings(url: str) -> dict:
        repeat = sizes.embed_tokens // SENTENCE_TOKENS
        inputs = [f"{time.time()} {i} " + SENTENCE * repeat for i in range(sizes.embed_inputs)]
        r = _post(url, "/v1/embeddings", {"input": inputs, "user": "burden"})
        r.raise_for_status()
        return {"input_tokens": r.json()["usage"]["prompt_tokens"]}

    def slow_schemas(url: str) -> dict:
        seed = int(time.time()) % 1000  # schemas of their own: no earlier run's compiled grammar serves them
        statuses: list[int] = []

        def one(k: int) -> None:
            statuses.append(
                _post(
                    url,
                    "/v1/chat/completions",
                    {
                        "messages": [{"role": "user", "content": "hi"}],
                        "max_tokens": 1,
                        "user": f"burden-{k}",
                        "response_format": {
                            "type": "json_schema",
                            "json_schema": {
                                "name": "x",
                                "schema": slow_schema(seed + k, sizes.schema_patterns),
                            },
                        },
                    },
                ).status_code
            )

        _run_together([lambda k=k: one(k) for k in range(2)])
        return {"schema_statuses": sorted(statuses)}

    def many_prompts(url: str) -> dict:
        prompts = [f"{time.time()} {i} " + SENTENCE * 4 for i in range(sizes.prompts)]
        r = _post(
            url,
            "/v1/completions",
            {"prompt": prompts, "max_tokens": sizes.prompt_new_tokens, "ignore_eos": True, "user": "burden"},
        )
        r.raise_for_status()
        return {"completion_tokens": r.json()["usage"]["completion_tokens"]}

    def competing_process(url: str) -> dict:
        spin = f"import time\nend = time.time() + {sizes.competing_s}\nwhile time.time() < end: pass"
        procs = [subprocess.Popen([sys.executable, "-c", spin]) for _ in range(os.cpu_count() or 2)]
        for p in procs:
            p.wait()
        return {"processes": len(procs)}

    return {
        "long_prompt": long_prompt,
        "embeddings": embeddings,
        "two_slow_schemas": slow_schemas,
        "completion_128_prompts": many_prompts,
        "competing_process": competing_process,
    }


def _run_together(calls: list[Callable[[], None]]) -> None:
    threads = [threading.Thread(target=c) for c in calls]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
