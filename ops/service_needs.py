"""What the LLM service's models need on the card, asked of the engine before it starts.

Scriptorium's engine answers `serve ... --print-memory-need` with its largest model's weights, smallest KV
cache and activations (backend/server/memory_need.py): a server of several models unloads the others to make room, so
the largest one alone is what its budget must hold. ops runs the service's own native command with that flag,
so the answer is for exactly the models and settings it will start. `x-ops.gpu_memory: auto` takes it as the
budget. A budget given as a size or fraction is not measured (the engine takes seconds to answer); one too
small for the model is refused by the engine itself when it starts.
"""

import json
import subprocess
from dataclasses import dataclass, replace

from common.gpu import Device
from ops.stack import Service

FLAG = "--print-memory-need"


@dataclass
class Need:
    service: str
    bytes: int | None  # None: not measured (see why)
    largest: str | None = None  # the model that needs the most
    why: str = ""


def measure(service: Service, runner: str, timeout: float = 120.0) -> Need:
    if service.engine != "scriptorium":
        return Need(service.name, None, why=f"only Scriptorium's engine reports its need ({service.engine} does not)")
    if runner != "process" or not service.native:
        return Need(service.name, None, why="measured with the native command, which the docker runner does not run")
    try:
        done = subprocess.run([*map(str, service.native), FLAG], capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as e:
        return Need(service.name, None, why=f"{service.native[0]} {FLAG} failed: {e}")
    if done.returncode != 0:
        lines = (done.stderr or done.stdout).strip().splitlines()
        return Need(service.name, None, why=lines[-1] if lines else f"{FLAG} exited {done.returncode}")
    try:
        answer = json.loads(done.stdout.strip().splitlines()[-1])
        return Need(service.name, int(answer["need_bytes"]), answer.get("largest"))
    except (ValueError, KeyError, IndexError, TypeError):
        return Need(service.name, None, why=f"{FLAG} printed no need: {done.stdout.strip()[-200:]!r}")


def with_needs(services: list[Service], devices: list[Device], runner: str) -> tuple[list[Service], dict[str, Need]]:
    """The services with their engine's need filled in where x-ops.gpu_memory is auto and there is a card (on
    the CPU nothing is budgeted)."""
    if not devices:
        return services, {}
    needs = {s.name: measure(s, runner) for s in services if s.gpu_memory == "auto"}
    return [replace(s, need=needs[s.name].bytes) if s.name in needs else s for s in services], needs
