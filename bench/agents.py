"""An agent's first turns on the embedded default (smollm2 on the CPU, served with 32768 tokens): time to first
token of a first turn with a long system prompt and tools (about 16,000 tokens), then of the next turn (the same
prefix, the reply, and about 200 new tokens; prefix caching should make it cost only those), streamed through
`/v1/chat/completions`. One JSON line; llama.cpp's row is null unless --llama-cpp-python names the python of a venv
with llama-cpp-python (bench/llama_cpp_peer.py). Run: python bench/agents.py [--system-tokens 16000]
"""

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import httpx  # noqa: E402

from backend.loader import load_tokenizer, locate  # noqa: E402
from backend.model_store import pull  # noqa: E402
from tests.backend.server_process import ServerProcess  # noqa: E402

TOOLS = [{"type": "function", "function": {
    "name": name, "description": f"{name.replace('_', ' ')} in the user's workspace",
    "parameters": {"type": "object", "properties": {"path": {"type": "string"}, "text": {"type": "string"}},
                   "required": ["path"]}}}
    for name in ("read_file", "write_file", "list_directory", "search_files", "run_tests", "open_url")]


def system_prompt(tokenizer, tokens: int) -> str:
    """Numbered house rules, as long agent system prompts are, until `tokens` tokens."""
    rules, n = [], 0
    while len(tokenizer("\n".join(rules))["input_ids"]) < tokens:
        rules.extend(f"Rule {n + i}: when a task touches module {(n + i) * 7 % 97}, read its tests first, keep "
                     f"changes under {(n + i) % 9 + 2} files, and report what was run." for i in range(100))
        n += 100
    return "You are a careful coding agent.\n" + "\n".join(rules)


def first_token_seconds(url: str, messages: list[dict]) -> tuple[float, int, str]:
    """Seconds to the first streamed token, the prompt's tokens, and the reply."""
    body = {"model": "smollm2", "messages": messages, "tools": TOOLS, "max_tokens": 16, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    started, first, prompt, text = time.perf_counter(), None, 0, []
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=1800) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                prompt = chunk["usage"]["prompt_tokens"]
            for choice in chunk.get("choices", []):
                delta = choice.get("delta", {})
                if delta.get("content") or delta.get("tool_calls"):
                    first = first or time.perf_counter()
                    text.append(delta.get("content") or "")
    return round((first or time.perf_counter()) - started, 2), prompt, "".join(text)


def llama_cpp_row(python: str | None, model: Path, conversations: list[list[dict]]) -> dict | None:
    """llama.cpp on the same file and turns, YaRN x4 as ours (bench/llama_cpp_peer.py's first_token job)."""
    if not python:
        return None
    peer = Path(__file__).resolve().parent / "llama_cpp_peer.py"
    job = {"mode": "first_token", "model": str(model), "conversations": conversations, "tools": TOOLS,
           "n_ctx": 32768, "trained": 8192, "threads": os.cpu_count()}
    done = subprocess.run([python, str(peer)], input=json.dumps(job), capture_output=True, text=True, check=True)
    return json.loads(done.stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--system-tokens", type=int, default=16000)
    parser.add_argument("--new-tokens", type=int, default=200, help="the next turn's new user message, in tokens")
    parser.add_argument("--llama-cpp-python", default=os.environ.get("LLAMA_CPP_PYTHON"),
                        help="the python of a venv with llama-cpp-python: adds llama.cpp's row")
    args = parser.parse_args()
    path = pull("smollm2")
    tokenizer = load_tokenizer(locate("smollm2"))
    system = system_prompt(tokenizer, args.system_tokens)
    first = [{"role": "system", "content": system}, {"role": "user", "content": "List the files under src/."}]
    server = ServerProcess("smollm2", "--max-num-seqs", "4", timeout=600)
    try:
        ttft1, prompt1, reply = first_token_seconds(server.url, first)
        ids = tokenizer(" ".join(f"src/module{i}.py" for i in range(args.new_tokens)))["input_ids"]
        words = tokenizer.decode(ids[: args.new_tokens - 12])  # the turn's template takes about 12 more
        second = [*first, {"role": "assistant", "content": reply},
                  {"role": "user", "content": f"Now check each of these: {words}"}]
        ttft2, prompt2, _ = first_token_seconds(server.url, second)
    finally:
        server.stop()
    print(json.dumps({"model": "smollm2 (CPU, max_model_len 32768, YaRN x4)", "cpus": os.cpu_count(),
                      "first_turn": {"prompt_tokens": prompt1, "ttft_s": ttft1},
                      "next_turn": {"prompt_tokens": prompt2, "new_tokens": prompt2 - prompt1, "ttft_s": ttft2},
                      "llama_cpp": llama_cpp_row(args.llama_cpp_python, path, [first, second])}))


if __name__ == "__main__":
    main()
