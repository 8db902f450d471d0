"""Priming the stdio front's remembered answers: `install` starts the entry's server once per protocol version
today's agents ask for, so that the agent's very first start finds its lists remembered (stdio_front.py)."""

import json
import subprocess
import threading
from pathlib import Path

from mcp_server.stdio_front import REMEMBERED, _line

PRIMED_VERSIONS = ("2025-06-18", "2025-11-25")  # what today's agents ask for (Codex, Claude Code)


def prime(command: list[str], env: dict[str, str], cwd: Path, timeout: float = 60) -> list[str]:
    """Start the server as an agent's entry does, once per protocol version in PRIMED_VERSIONS, at once, so
    that the agent's first start finds the answers remembered. Returns what went wrong, for a note."""
    problems: list[str] = []
    runs = [
        threading.Thread(target=_prime_one, args=(command, env, cwd, wanted, timeout, problems))
        for wanted in PRIMED_VERSIONS
    ]
    for run in runs:
        run.start()
    for run in runs:
        run.join()
    return problems


def _prime_one(
    command: list[str], env: dict[str, str], cwd: Path, wanted: str, timeout: float, problems: list[str]
) -> None:
    asked = [
        {
            "jsonrpc": "2.0",
            "id": 1,
            "method": "initialize",
            "params": {
                "protocolVersion": wanted,
                "capabilities": {},
                "clientInfo": {"name": "scriptorium-install", "version": "1"},
            },
        },
        {"jsonrpc": "2.0", "method": "notifications/initialized"},
        *({"jsonrpc": "2.0", "id": i, "method": m} for i, m in enumerate(REMEMBERED, start=2)),
    ]
    proc = subprocess.Popen(
        command, env=env, cwd=cwd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    killer = threading.Timer(timeout, proc.kill)
    killer.start()
    try:
        proc.stdin.write(b"".join(_line(m) for m in asked))
        proc.stdin.flush()
        waiting = {m["id"] for m in asked if "id" in m}
        for raw in proc.stdout:  # the SDK may drop what is in flight at EOF: close stdin once all is answered
            waiting.discard(json.loads(raw).get("id"))
            if not waiting:
                break
        proc.stdin.close()
        err = proc.stderr.read().decode(errors="replace").strip().splitlines()
        if proc.wait() != 0 or waiting:
            problems.append(f"the server did not answer ({wanted}): {err[-1] if err else proc.returncode}")
    except (OSError, ValueError) as e:
        problems.append(f"the server could not be asked ({wanted}): {e}")
    finally:
        killer.cancel()
        proc.kill()
