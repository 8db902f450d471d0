"""The agents' stream watchdogs against a request that waits long without output (behind another request
here, as behind a long prompt on a slow machine). Codex, its `stream_idle_timeout_ms` (300 s by default) set
to 10 s and its retries off: with the server's keepalive off it gives up with its idle timeout; with
response.in_progress every 2 s the same wait of six times its watchdog ends in an answer. Claude Code, whose
watchdog is never under 300 s: see its test. The model is a tiny one that ends every answer at once (SmolLM2
takes many minutes over Codex's prompt on loaded cores)."""

import os
import re
import subprocess
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.backend.agent_cli_env import cli, codex_home, environment
from tests.backend.blocking_request import Blocker
from tests.backend.server_process import ServerProcess
from tests.backend.tiny_models import TOOLS_CHAT_TEMPLATE, build_model

ASK = "What is the capital of France? Answer in one word."
IDLE_MS = 10_000
HOLD = 6 * IDLE_MS / 1000
HOLD_CLAUDE = 360.0


def quick_model(directory: Path) -> Path:
    """A tiny Qwen2 whose every next token is its end of sequence: its layers add nothing to the residual,
    every token embeds alike, and only the end-of-sequence row of its head reads the result."""
    build_model("qwen2", directory, chat_template=TOOLS_CHAT_TEMPLATE, max_position_embeddings=262144)
    path = directory / "model.safetensors"
    weights = load_file(path)
    for name, tensor in weights.items():
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            tensor.zero_()
    embed = weights["model.embed_tokens.weight"]
    embed[:] = embed[0]
    head = weights["lm_head.weight"]
    head.zero_()
    head[2] = 100 * torch.sign(embed[0] * weights["model.norm.weight"])  # token 2: the end of sequence
    save_file(weights, path, metadata={"format": "pt"})
    return directory


@pytest.mark.parametrize("keepalive", ["0", "2"], ids=["keepalive off", "keepalive every 2 s"])
def test_codex_survives_a_long_wait_only_with_the_keepalive(tmp_path, keepalive):
    codex = cli("codex")
    model = quick_model(tmp_path / "quick")
    server = ServerProcess(
        str(model),
        "--served-model-name",
        "smollm2",
        "--max-model-len",
        "262144",
        "--max-num-seqs",
        "1",
        "--stream-keepalive",
        keepalive,
        "--shutdown-timeout",
        "5",
        log_path=tmp_path / "serve.log",
    )
    try:
        codex_home(
            tmp_path, server.url, stream_idle_timeout_ms=IDLE_MS, stream_max_retries=0, request_max_retries=0
        )
        blocker = Blocker(server.url, "smollm2")
        proc = subprocess.Popen(
            [str(codex), "exec", "--skip-git-repo-check", "--color", "never", ASK],
            cwd=tmp_path,
            env=environment(tmp_path, {"SCRIPTORIUM_API_KEY": "unused"}),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            stdin=subprocess.DEVNULL,
        )
        held, out = _through_the_hold(proc, blocker, HOLD, timeout=900)  # held: Codex gave up before it ended
        if keepalive == "0":
            assert held and proc.returncode != 0, out
            assert "idle timeout waiting for SSE" in out, out
        else:
            assert not held, out  # it was still waiting when the hold ended: six times its watchdog
            assert proc.returncode == 0, out
            assert "idle timeout" not in out, out
    finally:
        assert server.stop() == 0


def _through_the_hold(
    proc: subprocess.Popen, blocker: Blocker, seconds: float, timeout: float
) -> tuple[bool, str]:
    """Whether proc ended while the blocker held the engine for `seconds`, then, the hold released, its output
    (proc killed if it is not done within timeout)."""
    try:
        ended = _wait(proc, seconds)
        assert blocker.release(), "the blocking generation ended before the hold did"
        out, _ = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return ended, out


def _wait(proc: subprocess.Popen, seconds: float) -> bool:
    """Whether proc ended within seconds."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return True
        time.sleep(0.2)
    return False


@pytest.mark.slow
@pytest.mark.skipif(
    os.environ.get("SCRIPTORIUM_WATCHDOG_MEASUREMENT") != "1",
    reason="about 14 minutes (Claude Code's watchdog is never under 300 s): run with SCRIPTORIUM_WATCHDOG_MEASUREMENT=1",
)
@pytest.mark.parametrize("keepalive", ["0", "30"], ids=["keepalive off", "keepalive every 30 s"])
def test_claude_code_keeps_its_stream_through_a_long_wait_only_with_the_keepalive(tmp_path, keepalive):
    """Claude Code's watchdog (CLAUDE_STREAM_IDLE_TIMEOUT_MS, never under 300 s) counts every event but `ping`:
    kept waiting about 350 s after message_start with pings only, it drops the stream and asks again without
    streaming; with an empty text delta every 30 s it reads the one stream to its end. About 12 minutes: its
    watchdog cannot be set shorter."""
    claude = cli("claude")
    model = quick_model(tmp_path / "quick")
    log = tmp_path / "serve.log"
    server = ServerProcess(
        str(model),
        "--served-model-name",
        "quick",
        "--max-model-len",
        "262144",
        "--max-num-seqs",
        "1",
        "--model-alias",
        "claude-*=quick",
        "--stream-keepalive",
        keepalive,
        "--log-level",
        "info",
        "--shutdown-timeout",
        "5",
        log_path=log,
    )
    try:
        blocker = Blocker(server.url, "quick")
        env = environment(tmp_path, {"ANTHROPIC_BASE_URL": server.url, "ANTHROPIC_API_KEY": "unused"})
        proc = subprocess.Popen(
            [str(claude), "-p", ASK, "--model", "quick", "--tools", "", "--system-prompt", "Answer briefly."],
            cwd=tmp_path,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            stdin=subprocess.DEVNULL,
        )
        # past its watchdog's 300 s from its request, which it sends within seconds of starting
        ended, out = _through_the_hold(proc, blocker, HOLD_CLAUDE, timeout=600)
        assert not ended, out
        assert proc.returncode == 0, out
        posts = messages_posts(log)
        assert posts == (["200", "200"] if keepalive == "0" else ["200"]), (posts, out)
    finally:
        assert server.stop() == 0


def messages_posts(log: Path) -> list[str]:
    """The statuses of the /v1/messages requests answered (uvicorn logs each when its answer starts)."""
    return re.findall(r'"POST /v1/messages\S* HTTP/1.1" (\d+)', log.read_text())
