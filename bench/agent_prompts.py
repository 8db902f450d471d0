"""How many tokens of SmolLM2's tokenizer the agents' own CLIs send as their first prompt, with and without our
MCP server's tools: the figures docs/server.md and docs/agents.md quote.

Claude Code (`claude -p`, its default tools) and Codex (`codex exec`), as installed by `make tools`, run against a
`backend serve` on SmolLM2 whose context is shorter than their prompts: the server refuses each first request
with the prompt's size in tokens, counted through the chat template with the tools (no prefill, so it takes
seconds on any machine). Then `python -m mcp_server install` registers our server (its default toolset) with
each, and they run again: the difference is what our tools cost in that agent's prompt (Claude Code told to wait
for its MCP servers: by default `claude -p` sends its first request without the tools of a server that has not
answered its tools, prompts and resources lists yet). Telemetry and update checks
are off, in an empty directory and home. Prints one JSON line.

Run: python bench/agent_prompts.py
"""

import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.backend.agent_cli_env import QUIET, codex_home  # noqa: E402
from tests.backend.server_process import ServerProcess  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
ASK = "What is the capital of France? Answer in one word."
REFUSED = re.compile(r"answered /v1/(?:messages|responses) 400: .*the prompt has (\d+) tokens")


def cli(name: str) -> Path:
    path = ROOT / ".tools" / "npm" / "bin" / name
    if not path.exists():
        raise SystemExit(f"the {name} CLI is not installed: `make tools` installs it (needs npm)")
    return path


def version(name: str) -> str:
    return subprocess.run([cli(name), "--version"], capture_output=True, text=True).stdout.strip()


def prompt_tokens(server: ServerProcess, log: Path, args: list, home: Path, env: dict) -> int:
    """The size of the first prompt the CLI sent, read from the server's refusal of it."""
    seen = len(REFUSED.findall(log.read_text()))
    base = {"PATH": os.environ["PATH"], "HOME": str(home), **QUIET, **env}
    subprocess.run(
        [str(a) for a in args], cwd=home, env=base, capture_output=True, timeout=300, stdin=subprocess.DEVNULL
    )
    sizes = REFUSED.findall(log.read_text())[seen:]
    if not sizes:
        raise SystemExit(f"{args[0]} sent no prompt the server refused; see {log}")
    return int(sizes[0])


def install(client: str, home: Path, home_dir: str) -> None:
    env = {
        "PATH": os.environ["PATH"],
        "HOME": str(home),
        "SCRIPTORIUM_HOME": home_dir,
        "PYTHONPATH": str(ROOT),
    }
    subprocess.run(
        [sys.executable, "-m", "mcp_server", "install", "--client", client, "--no-cli"],
        cwd=home,
        env=env,
        check=True,
        capture_output=True,
        timeout=120,
    )


def main() -> None:
    from backend.model_store import pull
    from common.paths import data_home

    model, home_dir = pull("smollm2"), str(data_home())
    row = {
        "bench": "agent_prompts",
        "model": "smollm2",
        "claude_code": version("claude"),
        "codex": version("codex"),
    }
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "serve.log"
        server = ServerProcess(
            str(model),
            "--served-model-name",
            "smollm2",
            "--max-model-len",
            "2048",
            "--model-alias",
            "claude-*=smollm2",
            "--log-level",
            "debug",
            log_path=log,
        )
        try:
            claude, codex = Path(tmp) / "claude", Path(tmp) / "codex"
            claude.mkdir(), codex.mkdir()
            claude_args = [cli("claude"), "-p", ASK, "--model", "smollm2"]
            claude_env = {  # Claude Code's -p waits up to 5 s for its MCP servers' lists, not sending without them
                "MCP_CONNECTION_NONBLOCKING": "false",
                "ANTHROPIC_BASE_URL": server.url,
                "ANTHROPIC_API_KEY": "unused",
                "SCRIPTORIUM_HOME": home_dir,
            }
            codex_args = [cli("codex"), "exec", "--skip-git-repo-check", "--color", "never", ASK]
            codex_env = {"SCRIPTORIUM_API_KEY": "unused", "SCRIPTORIUM_HOME": home_dir}
            codex_home(codex, server.url)
            row["claude_code_prompt_tokens"] = prompt_tokens(server, log, claude_args, claude, claude_env)
            row["codex_prompt_tokens"] = prompt_tokens(server, log, codex_args, codex, codex_env)
            install("claude-code", claude, home_dir)
            install("codex", codex, home_dir)
            with_ours = prompt_tokens(server, log, claude_args, claude, claude_env)
            row["claude_code_core_toolset_tokens"] = with_ours - row["claude_code_prompt_tokens"]
            with_ours = prompt_tokens(server, log, codex_args, codex, codex_env)
            row["codex_core_toolset_tokens"] = with_ours - row["codex_prompt_tokens"]
        finally:
            server.stop()
    print(json.dumps(row))


if __name__ == "__main__":
    main()
