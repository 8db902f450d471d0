"""The GPU lease file every process shares: who holds the card, whether the LLM sleeps for ComfyUI.

state/lease.json is read and written under an exclusive lock (state/lease.lock); state/lease-events.log
says what happened. orchestrator.image_lease takes leases for image jobs; ops reads them (status) and
repairs those whose holders died (health). Giving the card back (ComfyUI frees its models, the LLM
wakes) is here because both do it.
"""

import asyncio
import contextlib
import fcntl
import json
import os
import time
from pathlib import Path

import httpx

from common import backend_client, gpu
from common.files import atomic_write_text
from common.procs import ProcessIdentity, start_time

EXPIRY = 3600.0  # a lease nobody renews is repaired after this long
backend_root = backend_client.root


class LeaseError(Exception):
    pass


def holder_alive(pid: str, lease: dict) -> bool:
    """Whether the process that took a share of the lease still runs. Its start time, kept beside the pid,
    tells it from a later process that got the same pid (which would keep a dead lease alive, and the LLM
    asleep, until it expired); leases written before start times were kept go by the pid alone."""
    try:
        started = (lease.get("starts") or {}).get(pid)
        return ProcessIdentity(int(pid), started if isinstance(started, int) else None).alive()
    except (TypeError, ValueError):
        return False


def join(lease: dict) -> None:
    """Count this process as a holder of the lease, with its start time."""
    me = str(os.getpid())
    holders = lease.setdefault("holders", {})
    holders[me] = holders.get(me, 0) + 1
    lease.setdefault("starts", {})[me] = start_time(os.getpid())


class LeaseFile:
    """state/lease.json under an exclusive lock (state/lease.lock), and state/lease-events.log."""

    def __init__(self, home: Path):
        self.dir = home / "state"
        self.path = self.dir / "lease.json"
        self.lock_path = self.dir / "lease.lock"
        self.events = self.dir / "lease-events.log"

    @contextlib.contextmanager
    def locked(self):
        self.dir.mkdir(parents=True, exist_ok=True)
        with open(self.lock_path, "a") as handle:
            fcntl.flock(handle, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(handle, fcntl.LOCK_UN)

    def read(self) -> dict | None:
        try:
            return json.loads(self.path.read_text())
        except (OSError, ValueError):
            return None

    def write(self, lease: dict) -> None:
        # fsynced: after a crash the lease must still say the LLM sleeps, or nobody wakes it
        atomic_write_text(self.path, json.dumps(lease, indent=2))

    def clear(self) -> None:
        self.path.unlink(missing_ok=True)

    def event(self, kind: str, **data) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        with open(self.events, "a") as f:
            f.write(json.dumps({"time": time.time(), "pid": os.getpid(), "event": kind, **data}) + "\n")


async def free_memory(comfyui_url: str | None) -> int | None:
    """Free bytes on the card: the probe's figure, with ComfyUI's as a second opinion (the smaller wins)."""
    devices, _ = gpu.probe()
    figures = [devices[0].free] if devices else []
    if comfyui_url:
        try:
            async with httpx.AsyncClient(timeout=10) as http:
                stats = (await http.get(f"{comfyui_url}/system_stats")).json()
            device = (stats.get("devices") or [{}])[0]
            if device.get("type") != "cpu" or not devices:
                figures.append(int(device["vram_free"]))
        except (httpx.HTTPError, ValueError, KeyError, IndexError):
            pass
    return min(figures) if figures else None


FREE_MARGIN = 512 << 20  # what ComfyUI may keep after /free (allocator cache) and still count as given back


async def give_back_async(file: LeaseFile, backend: str | None, comfyui: str | None, memory_timeout: float,
                          reason: str, api_key: str | None = None) -> None:
    """ComfyUI frees its models (polled until the memory is back), then the LLM wakes through the sleep API the
    lease says it was put to sleep with (backend_client), with the server's API key if it has one; the lease ends.

    The memory is back once the card is as free as when it was lent (the lease's `lent_free`): a holder
    killed before ComfyUI loaded anything gives back at once rather than after the timeout. Leases written
    before that record wait for any rise in free memory."""
    lease = file.read() or {}
    api, lent_free = lease.get("sleep_api", "scriptorium"), lease.get("lent_free")
    async with httpx.AsyncClient(timeout=30) as http:
        if comfyui:
            before = await free_memory(comfyui)
            try:
                await http.post(f"{comfyui}/free", json={"unload_models": True, "free_memory": True})
                file.event("free", reason=reason)
                deadline = time.monotonic() + memory_timeout
                while time.monotonic() < deadline:  # /free only sets a flag: wait until it took effect
                    now_free = await free_memory(comfyui)
                    if before is None or now_free is None:
                        break
                    if now_free >= lent_free - FREE_MARGIN if lent_free is not None else now_free > before:
                        break
                    await asyncio.sleep(0.5)
            except httpx.HTTPError as e:
                file.event("free-failed", error=str(e))
        if backend:
            try:
                response = await backend_client.wake_up(http, backend, api, api_key)
                if response.status_code >= 400:
                    raise httpx.HTTPStatusError(f"{response.status_code}: {response.text[:200]}",
                                                request=response.request, response=response)
                file.event("wake", reason=reason)
            except httpx.HTTPError as e:
                file.event("wake-failed", error=str(e))
                raise LeaseError(f"could not wake the LLM server at {backend}: {e}; `ops health` retries") from None
    file.clear()


