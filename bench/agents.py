"""An agent's turns on the CPU default, ours beside llama.cpp on the same GGUF (SmolLM2-135M Q4_1, `models pull`).

The first turn is agent-shaped: a system prompt of about 16,000 tokens with its tools' schemas in it, as
Claude Code and Hermes send, after Claude Code's billing line (a first system block that changes with every
prompt), then a user message. The next turn is the same conversation plus the model's answer and a new user
message (200 new tokens). Another run is a second `claude -p` with another question: a new billing line, the
same system prompt; then the same after a restart of the server (ours: from the disk prefix cache; llama.cpp: a
new process, which keeps nothing). For each, the time to the first token: ours through
/v1/messages (what Claude Code calls; max_tokens 1, so the answer's time is the prompt's plus one token),
llama.cpp through llama-cpp-python in its own venv on the same token ids (row null without
--llama-cpp-python PATH or LLAMA_CPP_PYTHON). Cached tokens: ours as each answer's usage reports them; llama.cpp's
are the prefix it keeps from the turn before in the same process (the common prefix of the two prompts, as
llama.cpp's server and llama-cpp-python reuse it; none after a restart), worked out from the token ids. The system
prompt starts with this run's time, so that no earlier run's disk cache serves it. Prints one JSON line.

Run: python bench/agents.py [--system-tokens 16000] [--llama-cpp-python /path/to/venv/bin/python]
"""

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import httpx  # noqa: E402
from run_peer import run_peer  # noqa: E402  (bench/, beside this script)

from tests.backend.server_process import ServerProcess  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
TOOL = {
    "name": "tool_{i}",
    "description": "Runs step {i} of the writer's workflow on the named file and "
    "returns what changed, as a unified diff, with a summary of each hunk.",
    "input_schema": {
        "type": "object",
        "properties": {
            "path": {"type": "string", "description": "The file, relative to the project root."},
            "mode": {"type": "string", "enum": ["check", "apply", "explain"]},
            "limit": {"type": "integer", "description": "At most this many hunks."},
        },
        "required": ["path"],
    },
}


def system_prompt(url: str, tokens: int) -> str:
    """This run's time, our own documentation repeated up to `tokens` tokens, then 24 tools written out as an
    agent's prompt carries them."""
    tools = "\n".join(json.dumps(json.loads(json.dumps(TOOL).replace("{i}", str(i)))) for i in range(24))
    text = (ROOT / "README.md").read_text()
    body = f"Session started at {time.time():.6f}.\n"
    while count(url, body + tools) < tokens:
        body += text
    lo, hi = 0, len(body)  # the longest prefix of body that keeps the total within tokens
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if count(url, body[:mid] + tools) <= tokens else (lo, mid - 1)
    return body[:lo] + "\n\n# Tools\n" + tools


def count(url: str, text: str) -> int:
    r = httpx.post(f"{url}/tokenize", json={"prompt": text, "add_special_tokens": False}, timeout=120)
    r.raise_for_status()
    return r.json()["count"]


def turns() -> list[tuple[str, list[dict]]]:
    """(billing line, conversation) of the first turn, the next turn, another run's first turn, and a run's after a
    restart."""
    first = [{"role": "user", "content": "Read the project's design and list the three services it starts."}]
    answer = "The stack starts the backend, the MCP server and, when configured, ComfyUI. " * 6
    follow = "Now explain, step by step, how ops decides the order in which they start and why. " * 6
    other = [{"role": "user", "content": "Which port does the MCP server listen on, and why that one?"}]
    later = [
        {
            "role": "user",
            "content": "Where does the backend keep the models it pulls, and how large are they?",
        }
    ]
    line = "x-anthropic-billing-header: cc_version=2.1.197.{}; cc_entrypoint=sdk-cli;"
    return [
        (line.format("73f"), first),
        (
            line.format("73f"),
            [*first, {"role": "assistant", "content": answer}, {"role": "user", "content": follow}],
        ),
        (line.format("a02"), other),
        (line.format("c5e"), later),
    ]


def ours(url: str, system: str, billing: str, conversation: list[dict]) -> tuple[float, dict]:
    blocks = [{"type": "text", "text": billing}, {"type": "text", "text": system}]
    body = {"model": "smollm2", "max_tokens": 1, "system": blocks, "messages": conversation, "temperature": 0}
    start = time.perf_counter()
    r = httpx.post(f"{url}/v1/messages", json=body, timeout=1200)
    r.raise_for_status()
    return time.perf_counter() - start, r.json()["usage"]


def prompt_ids(url: str, system: str, billing: str, conversation: list[dict]) -> list[int]:
    """The prompt as llama.cpp's server builds it: the billing line kept first in the system prompt."""
    messages = [{"role": "system", "content": f"{billing}\n{system}"}, *conversation]
    r = httpx.post(f"{url}/tokenize", json={"messages": messages}, timeout=120)
    r.raise_for_status()
    return r.json()["tokens"]


def llama_cpp(
    python: str | None, model: Path, turns_ids: list[list[int]], n_ctx: int, restart_before: list[int]
) -> list[float] | None:
    """Seconds to the first token of each turn in one process, but those in restart_before, which a new process
    starts."""
    if not python:
        return None
    import gguf

    trained = int(gguf.GGUFReader(model).fields["llama.context_length"].contents())
    job = {
        "model": str(model),
        "turns": turns_ids,
        "threads": os.cpu_count(),
        "n_ctx": n_ctx,
        "trained": trained,
        "restart_before": restart_before,
    }
    return run_peer("llama_cpp_turns.py", job, python)["seconds"]


def llama_cpp_cached(turns_ids: list[list[int]], restart_before: list[int]) -> list[int]:
    """The tokens of each turn llama.cpp does not compute again: the common prefix with the prompt before it in the
    same process (at most all but the last token, which it evaluates to sample from)."""
    cached = []
    for i, ids in enumerate(turns_ids):
        before = turns_ids[i - 1] if i and i not in restart_before else []
        common = next((n for n, (a, b) in enumerate(zip(before, ids)) if a != b), min(len(before), len(ids)))
        cached.append(min(common, len(ids) - 1))
    return cached


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--system-tokens", type=int, default=16000)
    parser.add_argument("--max-model-len", type=int, default=32768)
    parser.add_argument("--llama-cpp-python", default=os.environ.get("LLAMA_CPP_PYTHON"))
    args = parser.parse_args()
    from backend.model_store import pull

    model = pull("smollm2")
    flags = ("--max-model-len", str(args.max_model_len))
    server = ServerProcess("smollm2", *flags)
    try:
        system = system_prompt(server.url, args.system_tokens)
        runs = turns()
        (first_s, _), (next_s, next_usage), (other_s, other_usage) = (
            ours(server.url, system, b, c) for b, c in runs[:3]
        )
        ids = [prompt_ids(server.url, system, b, c) for b, c in runs]
    finally:
        server.stop()
    server = ServerProcess("smollm2", *flags)  # the disk prefix cache is what it keeps
    try:
        restart_s, restart_usage = ours(server.url, system, *runs[3])
    finally:
        server.stop()
    restart = [len(ids) - 1]  # the last run's, as ours after a restart of the server
    peer = llama_cpp(args.llama_cpp_python, model, ids, args.max_model_len, restart)
    prompt = [len(i) for i in ids]
    row = {
        "bench": "agents",
        "model": "smollm2",
        "device": "cpu",
        "threads": os.cpu_count(),
        "first_turn_tokens": prompt[0],
        "next_turn_new_tokens": prompt[1] - prompt[0],
        "first_ttft_s": round(first_s, 3),
        "first_prompt_tok_s": round(prompt[0] / first_s, 1),
        "next_ttft_s": round(next_s, 3),
        "next_cached_tokens": next_usage["cache_read_input_tokens"],
        "another_run_tokens": prompt[2],
        "another_run_ttft_s": round(other_s, 3),
        "another_run_cached_tokens": other_usage["cache_read_input_tokens"],
        "after_restart_tokens": prompt[3],
        "after_restart_ttft_s": round(restart_s, 3),
        "after_restart_cached_tokens": restart_usage["cache_read_input_tokens"],
        "llama_cpp_first_ttft_s": None,
        "llama_cpp_first_prompt_tok_s": None,
        "llama_cpp_next_ttft_s": None,
        "llama_cpp_another_run_ttft_s": None,
        "llama_cpp_after_restart_ttft_s": None,
    }
    if peer is not None:
        peer_cached = llama_cpp_cached(ids, restart)
        row.update(
            llama_cpp_next_cached_tokens=peer_cached[1],
            llama_cpp_another_run_cached_tokens=peer_cached[2],
            llama_cpp_after_restart_cached_tokens=peer_cached[3],
            llama_cpp_first_ttft_s=round(peer[0], 3),
            llama_cpp_first_prompt_tok_s=round(prompt[0] / peer[0], 1),
            llama_cpp_next_ttft_s=round(peer[1], 3),
            first_prompt_vs_llama_cpp=round(peer[0] / first_s, 2),
            llama_cpp_another_run_ttft_s=round(peer[2], 3),
            another_run_vs_llama_cpp=round(peer[2] / other_s, 2),
            llama_cpp_after_restart_ttft_s=round(peer[3], 3),
            after_restart_vs_llama_cpp=round(peer[3] / restart_s, 2),
        )
    print(json.dumps(row))


if __name__ == "__main__":
    main()
