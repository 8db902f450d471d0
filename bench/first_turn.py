"""Claude Code's first turn, for bench/interactive_load.py: its request recorded from the real CLI, then sent to
our server cold and again after a restart (the disk prefix cache is what a restart keeps).

Recording: `claude -p` (as `make tools` installs it) is pointed at a listener of our own that keeps the largest
/v1/messages body it is sent and refuses it with a 400, so the CLI exits at once (no model, no prefill). The body
is Claude Code's own prompt (its system prompt, default tools, this question), about 21,000 tokens of SmolLM2's
tokenizer with 2.1.197; it is kept only in a temporary directory, or where --first-turn-body says. Without the CLI
a prompt of the same shape is built by bench/agents.py's `system_prompt` (`"source": "synthesized"`).
"""

import json
import os
import subprocess
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
from agents import system_prompt  # bench/, beside this script

from common.paths import data_home
from tests.backend.agent_cli_env import CLIS, QUIET
from tests.backend.server_process import ServerProcess

CLAUDE = CLIS / "claude"
ASK = "Read the project's design and list the three services it starts."


def _recorder(bodies: list[dict]):
    class Recorder(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 (http.server's name)
            raw = self.rfile.read(int(self.headers.get("content-length") or 0))
            if self.path.startswith("/v1/messages") and "count_tokens" not in self.path:
                bodies.append(json.loads(raw))
            answer = json.dumps(
                {
                    "type": "error",
                    "error": {"type": "invalid_request_error", "message": "recorded by bench/first_turn.py"},
                }
            ).encode()
            self.send_response(400)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(answer)))
            self.end_headers()
            self.wfile.write(answer)

        def log_message(self, *args) -> None:
            pass

    return Recorder


def record_claude_code() -> tuple[dict, str]:
    """(Claude Code's first /v1/messages body for ASK, its version)."""
    bodies: list[dict] = []
    listener = ThreadingHTTPServer(("127.0.0.1", 0), _recorder(bodies))
    threading.Thread(target=listener.serve_forever, daemon=True).start()
    try:
        with tempfile.TemporaryDirectory() as home:
            env = {
                "PATH": os.environ["PATH"],
                "HOME": home,
                **QUIET,
                "ANTHROPIC_API_KEY": "unused",
                "ANTHROPIC_BASE_URL": f"http://127.0.0.1:{listener.server_address[1]}",
            }
            subprocess.run(
                [str(CLAUDE), "-p", ASK],
                cwd=home,
                env=env,
                capture_output=True,
                timeout=300,
                stdin=subprocess.DEVNULL,
            )
    finally:
        listener.shutdown()
    if not bodies:
        raise SystemExit(f"{CLAUDE} sent no /v1/messages request to the recorder")
    version = subprocess.run([str(CLAUDE), "--version"], capture_output=True, text=True).stdout.split()
    return max(bodies, key=lambda b: len(json.dumps(b))), (version or ["?"])[0]


def synthesized(url: str, tokens: int) -> dict:
    """A first turn of Claude Code's shape (billing line, a long system prompt with tools' schemas, a question)."""
    billing = "x-anthropic-billing-header: cc_version=2.1.197.73f; cc_entrypoint=sdk-cli;"
    return {
        "system": [{"type": "text", "text": billing}, {"type": "text", "text": system_prompt(url, tokens)}],
        "messages": [{"role": "user", "content": ASK}],
    }


def first_turn_body(url: str, saved: Path | None, synthesize_tokens: int | None) -> tuple[dict, str]:
    """(the body, where it came from): saved (a file an earlier run recorded), else recorded from the CLI, else
    (or when synthesize_tokens says) built here."""
    if saved is not None and saved.exists():
        record = json.loads(saved.read_text())
        return record["body"], record["source"]
    if synthesize_tokens is None and CLAUDE.exists():
        body, version = record_claude_code()
        source = f"claude-code {version}, recorded"
    else:
        body, source = synthesized(url, synthesize_tokens or 21000), "synthesized"
    if saved is not None:
        saved.write_text(json.dumps({"source": source, "body": body}))
    return body, source


def send(url: str, body: dict, model: str) -> tuple[float, dict]:
    """(seconds to the answer's first token, usage): max_tokens 1, as bench/agents.py times a turn."""
    request = {**body, "model": model, "max_tokens": 1, "stream": False, "temperature": 0}
    start = time.perf_counter()
    r = httpx.post(f"{url}/v1/messages", json=request, timeout=3600)
    r.raise_for_status()
    return time.perf_counter() - start, r.json()["usage"]


def start_server(model: Path, *flags: str) -> ServerProcess:
    """A server on the model, ready; stopped again if it does not get ready (a loaded machine: up to 15 min)."""
    server = ServerProcess(str(model), *flags, wait=False)
    try:
        server.wait_ready(900)
    except BaseException:
        server.stop()
        raise
    return server


def home_without_kv(home: Path) -> None:
    """A SCRIPTORIUM_HOME whose disk prefix cache is empty and whose other caches (built kernels, packed weights,
    tokenizers) are the user's, linked: a fresh home would rebuild them first (minutes on a loaded machine)."""
    real = data_home()
    (home / "cache").mkdir()
    for part in ("native", "packed", "tokenizers"):
        if (real / "cache" / part).is_dir():
            (home / "cache" / part).symlink_to(real / "cache" / part)


def cold_then_restart(
    model: Path, max_model_len: int, saved: Path | None, synthesize_tokens: int | None
) -> dict:
    """The first turn on a server whose disk prefix cache is empty (a new SCRIPTORIUM_HOME), then on a new server
    over the same home."""
    flags = ("--served-model-name", "smol", "--max-model-len", str(max_model_len))
    before = os.environ.get("SCRIPTORIUM_HOME")
    with tempfile.TemporaryDirectory() as home:
        home_without_kv(Path(home))
        os.environ["SCRIPTORIUM_HOME"] = home  # the servers' (children inherit it); the model file is outside
        try:
            server = start_server(model, *flags)
            try:
                body, source = first_turn_body(server.url, saved, synthesize_tokens)
                cold_s, cold = send(server.url, body, "smol")
            finally:
                server.stop()  # a SIGTERM lets the disk writer finish
            server = start_server(model, *flags)
            try:
                restart_s, restart = send(server.url, body, "smol")
            finally:
                server.stop()
        finally:
            if before is None:
                os.environ.pop("SCRIPTORIUM_HOME", None)
            else:
                os.environ["SCRIPTORIUM_HOME"] = before
    tokens = cold["input_tokens"] + cold.get("cache_read_input_tokens", 0)
    return {
        "source": source,
        "prompt_tokens": tokens,
        "cold_ttft_s": round(cold_s, 3),
        "after_restart_ttft_s": round(restart_s, 3),
        "after_restart_cached_tokens": restart.get("cache_read_input_tokens", 0),
    }
