"""The agents' own CLIs with this server as their model: Claude Code over the Messages API, Codex over the
Responses API, as their users start them (telemetry and update checks off). Each run must exit 0 with an
answer, and the server must have answered every request it got with a 2xx."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.backend.agent_cli_env import cli, codex_home, environment
from tests.backend.server_process import ServerProcess
from tests.backend.tiny_models import TOOLS_CHAT_TEMPLATE, build_model

ROOT = Path(__file__).resolve().parents[2]
ASK = "What is the capital of France? Answer in one word."


class LoggedServer(ServerProcess):
    """A server whose log (uvicorn's access lines included) is kept in a file, to read what it answered."""

    def __init__(self, log: Path, *args: str):
        self.log = log
        os.environ["SERVER_LOG"] = str(log)
        try:
            super().__init__(*args)
        finally:
            del os.environ["SERVER_LOG"]

    def statuses(self, path: str) -> list[int]:
        text = self.log.read_text()
        return [int(s) for s in re.findall(rf'"(?:POST|GET|HEAD) {re.escape(path)}\S* HTTP/1.1" (\d+)', text)]

    def refusals(self) -> list[str]:
        """Every 4xx or 5xx answered to a client (the test's own waits on /health while loading aside)."""
        return re.findall(r'"(?:POST|GET|HEAD) (?!/health )\S+ HTTP/1.1" [45]\d\d.*', self.log.read_text())


def run(args: list, home: Path, env: dict, timeout: float = 900) -> subprocess.CompletedProcess:
    return subprocess.run([str(a) for a in args], cwd=home, env=environment(home, env), capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL)


@pytest.fixture(scope="module")
def smol(tmp_path_factory):
    """SmolLM2 with room for Codex's prompt of ~9,200 tokens and aliases for Claude Code's model names. 12,288
    tokens, not serve's 32,768: Codex asks for no output limit and Claude Code for 32,000 tokens, at temperature 1,
    and a small model that rambles would run to the end of the context (many minutes); here the context ends it
    in a few. (Claude Code's CLAUDE_CODE_MAX_OUTPUT_TOKENS is no bound: it exits 1 when an answer reaches it.) Claude Code's billing line
    is kept in its prompt here: a random small model's answer to that prompt ends before the context does (one that
    runs to the end makes Claude Code ask to continue past the context, which is a 400)."""
    log = tmp_path_factory.mktemp("logs") / "smol.log"
    server = LoggedServer(log, "smollm2", "--max-model-len", "12288", "--model-alias", "claude-*=smollm2",
                          "--log-level", "debug", "--keep-attribution-header")
    yield server
    assert server.stop() == 0


def test_claude_code_answers_through_the_messages_api(smol, tmp_path):
    claude = cli("claude")
    out = run([claude, "-p", ASK, "--model", "smollm2", "--tools", "", "--system-prompt",
               "You are a helpful assistant. Answer briefly."], tmp_path,
              {"ANTHROPIC_BASE_URL": smol.url, "ANTHROPIC_API_KEY": "unused"})
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.strip()
    assert smol.statuses("/v1/messages") and set(smol.statuses("/v1/messages")) == {200}
    assert not smol.refusals()


@pytest.mark.parametrize("restart", [False, True], ids=["same server", "after a restart"])
def test_claude_codes_second_run_reads_the_shared_prompt_from_cache(tmp_path, restart):
    """Claude Code puts a billing line that changes with every prompt first in its system prompt; the server
    leaves it out, so a second run with another question reads the system prompt from the prefix cache: the
    same server's, or after a restart the disk prefix cache's."""
    claude = cli("claude")
    args = ("smollm2", "--max-model-len", "12288", "--model-alias", "claude-*=smollm2", "--log-level", "info")
    server = LoggedServer(tmp_path / "cache.log", *args)
    try:
        system = "You are the scriptorium's copyist: you answer questions about manuscripts in one short line. " * 3
        usages = []
        for question in (ASK, "Which ink did medieval scribes use? Answer in one word."):
            if usages and restart:
                assert server.stop() == 0
                server = LoggedServer(tmp_path / "cache.log", *args)
            out = run([claude, "-p", question, "--model", "smollm2", "--tools", "", "--system-prompt", system,
                       "--output-format", "json"], tmp_path, {"ANTHROPIC_BASE_URL": server.url,
                                                              "ANTHROPIC_API_KEY": "unused"})
            assert out.returncode == 0, out.stdout + out.stderr
            usages.append(json.loads(out.stdout)["usage"])
        count = httpx.post(f"{server.url}/tokenize", json={"model": "smollm2", "prompt": system}).json()["count"]
        assert usages[1]["cache_read_input_tokens"] >= count - 16, usages  # all but its last, partial block
    finally:
        assert server.stop() == 0


def test_claude_codes_whole_default_request_is_served(tmp_path, tmp_path_factory):
    """Claude Code's default request (24 tools, system blocks, thinking, context_management, a system message
    mid-conversation; ~20,000 tokens) on a tiny model with a long context: every request is answered 200 and
    the stream is read to its end (the model is random, so Claude Code stops at the output cap it was given)."""
    claude = cli("claude")
    model = build_model("qwen2", tmp_path_factory.mktemp("long") / "tiny", chat_template=TOOLS_CHAT_TEMPLATE,
                        max_position_embeddings=65536)
    server = LoggedServer(tmp_path / "tiny.log", str(model), "--served-model-name", "tiny", "--max-model-len",
                          "65536", "--model-alias", "claude-*=tiny", "--log-level", "info")
    try:
        out = run([claude, "-p", "say hi", "--model", "tiny"], tmp_path,
                  {"ANTHROPIC_BASE_URL": server.url, "ANTHROPIC_API_KEY": "unused",
                   "CLAUDE_CODE_MAX_OUTPUT_TOKENS": "8"})
        assert "exceeded the 8 output token maximum" in out.stdout + out.stderr, out.stdout + out.stderr
        assert server.statuses("/v1/messages") and set(server.statuses("/v1/messages")) == {200}
        assert not server.refusals()
    finally:
        assert server.stop() == 0


def test_codex_exec_answers_through_the_responses_api(smol, tmp_path):
    codex = cli("codex")
    codex_home(tmp_path, smol.url)
    out = run([codex, "exec", "--skip-git-repo-check", "--color", "never", ASK], tmp_path,
              {"SCRIPTORIUM_API_KEY": "unused"})
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.strip()
    assert smol.statuses("/v1/responses") and set(smol.statuses("/v1/responses")) == {200}
    assert not smol.refusals()
    log = smol.log.read_text()
    assert "'web_search' tools run on OpenAI's servers, not here; left out of the prompt" in log
    assert "multi_agent_v1__" in log  # Codex's own namespace, offered by qualified name


def test_codex_offers_our_mcp_tools_once_installed(smol, tmp_path):
    """`python -m mcp_server install --client codex` registers us; Codex starts our MCP server and offers its
    tools to the model in the same turn (they reach the prompt: the server logs the offered names)."""
    codex = cli("codex")
    codex_home(tmp_path, smol.url)
    env = {"SCRIPTORIUM_API_KEY": "unused", "SCRIPTORIUM_HOME": os.environ["SCRIPTORIUM_HOME"]}
    installed = run([sys.executable, "-m", "mcp_server", "install", "--client", "codex"], tmp_path,
                    {**env, "PYTHONPATH": str(ROOT)}, timeout=120)
    assert installed.returncode == 0, installed.stdout + installed.stderr
    before = smol.log.read_text().count("tools offered to the model")
    out = run([codex, "exec", "--skip-git-repo-check", "--color", "never", ASK], tmp_path, env)
    assert out.returncode == 0, out.stdout + out.stderr
    offered = [line for line in smol.log.read_text().splitlines() if "tools offered to the model" in line]
    assert any("scriptorium" in line and "generate_text" in line for line in offered[before:]), offered[before:]
