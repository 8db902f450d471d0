"""Telling someone that the stack is unhealthy: a command of theirs, or a webhook."""

import json
import os
import socket
import subprocess
import time

import httpx


def payload(report: dict) -> dict:
    failed = [s for s in report["services"] if s["state"] != "healthy"]
    return {
        "host": socket.gethostname(),
        "time": time.time(),
        "problems": report["problems"],
        "failed": [{"service": s["service"], "state": s["state"], "detail": s["detail"],
                    "since": report["failing_since"].get(s["service"])} for s in failed],
    }


def send(report: dict, command: str | None, webhook: str | None) -> list[str]:
    """Deliver the alert; returns what could not be delivered."""
    body = json.dumps(payload(report))
    errors = []
    if command:
        try:
            done = subprocess.run(command, shell=True, input=body, text=True, capture_output=True, timeout=60,
                                  env={**os.environ, "SCRIPTORIUM_ALERT": body})
            if done.returncode != 0:
                errors.append(f"{command!r} exited {done.returncode}: {done.stderr.strip()[-200:]}")
        except subprocess.TimeoutExpired:
            errors.append(f"{command!r} took longer than 60 s")
    if webhook:
        try:
            response = httpx.post(webhook, content=body, headers={"Content-Type": "application/json"}, timeout=15)
            if response.status_code >= 400:
                errors.append(f"{webhook} answered {response.status_code}")
        except httpx.HTTPError as e:
            errors.append(f"{webhook}: {type(e).__name__}: {e}")
    return errors
