"""Memory leases: the LLM lends the card to an image job, and gets it back.

Before an image job, the coordinator compares the memory the job needs with what is free (the GPU
probe, with ComfyUI's /system_stats as a second opinion). If it does not fit, the backend drains
and sleeps (/sleep: KV cache freed, weights moved off the card), the coordinator waits until the
memory is really free, the job runs, and once ComfyUI has been idle for a while it calls ComfyUI's
/free (polling, since /free only sets a flag) and wakes the backend. Leases are serialised across
processes with a file lock; a job arriving while the card is lent shares the lease. A lease
expires, and `ops health` repairs one whose holders died, so the LLM is never left asleep.
"""

import asyncio
import contextlib
import fcntl
import json
import os
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

from common import gpu
from common.files import atomic_write_text
from common.gpu import fmt
from common.procs import ProcessIdentity, start_time


class LeaseError(Exception):
    pass


@dataclass
class LeaseConfig:
    enabled: bool = True
    idle: float = 30.0  # seconds ComfyUI stays idle before the card goes back to the LLM
    drain_timeout: float = 120.0  # longest wait for the LLM's requests in flight to finish
    memory_timeout: float = 60.0  # longest wait for freed memory to show up on the card
    expiry: float = 3600.0  # a lease nobody renews is repaired after this long


def _holder_alive(pid: str, lease: dict) -> bool:
    """Whether the process that took a share of the lease still runs. Its start time, kept beside the pid,
    tells it from a later process that got the same pid (which would keep a dead lease alive, and the LLM
    asleep, until it expired); leases written before start times were kept go by the pid alone."""
    try:
        started = (lease.get("starts") or {}).get(pid)
        return ProcessIdentity(int(pid), started if isinstance(started, int) else None).alive()
    except (TypeError, ValueError):
        return False


def _join(lease: dict) -> None:
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


def backend_root(llm_url: str) -> str:
    """http://host:8000/v1 -> http://host:8000 (sleep and wake live beside the OpenAI routes)."""
    url = llm_url.rstrip("/")
    return url[:-3] if url.endswith("/v1") else url


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


class Coordinator:
    def __init__(self, home: Path, llm_url: str | None, comfyui_url: str, config: LeaseConfig):
        self.file = LeaseFile(home)
        self.backend = backend_root(llm_url) if llm_url else None
        self.comfyui = comfyui_url
        self.config = config
        self._local = asyncio.Lock()
        self._pending: list[asyncio.Task] = []

    @asynccontextmanager
    async def hold(self, needed: int, job: str):
        """Run the body with `needed` bytes of the card available, sleeping the LLM if it must."""
        async with self._local:  # one flock holder per process at a time: the flock itself would block the loop
            lent = await self._acquire(needed, job)
        try:
            yield
        finally:
            if lent:
                async with self._local:
                    self._release_later(job)

    async def _acquire(self, needed: int, job: str) -> bool:
        if not self.config.enabled or self.backend is None:
            return False
        with self.file.locked():
            lease = self.file.read()
            if lease is not None and lease.get("asleep"):
                _join(lease)
                lease["expires"] = time.time() + self.config.expiry
                self.file.write(lease)
                self.file.event("share", job=job)
                return True
            free = await free_memory(self.comfyui)
            if free is None or needed <= free:
                self.file.event("fits", job=job, needed=needed, free=free)
                return False
            self.file.event("sleep", job=job, needed=needed, free=free)
            try:
                async with httpx.AsyncClient(timeout=self.config.drain_timeout + 30) as http:
                    response = await http.post(f"{self.backend}/sleep",
                                               params={"level": 1, "timeout": self.config.drain_timeout})
            except httpx.HTTPError as e:
                self.file.event("refused", job=job, error=str(e))
                raise LeaseError(f"the image needs {fmt(needed)} of GPU memory but {fmt(free)} is free, and the LLM "
                                 f"server at {self.backend} could not be put to sleep ({type(e).__name__}: {e})") from None
            if response.status_code != 200:
                detail = response.text[:200]
                self.file.event("refused", job=job, status=response.status_code)
                raise LeaseError(f"the image needs {fmt(needed)} of GPU memory but {fmt(free)} is free, and the LLM "
                                 f"server at {self.backend} refused to sleep ({response.status_code}: {detail}); "
                                 "lower ComfyUI's memory (x-ops.gpu_memory, --lowvram) or let the backend sleep")
            now = time.time()
            lease = {"asleep": True, "since": now, "expires": now + self.config.expiry, "holders": {},
                     "last_job_end": None, "backend": self.backend, "comfyui": self.comfyui}
            _join(lease)
            self.file.write(lease)
            deadline = time.monotonic() + self.config.memory_timeout
            while True:
                free = await free_memory(self.comfyui)
                if free is None or free >= needed:
                    self.file.event("memory-free", job=job, free=free)
                    return True
                if time.monotonic() > deadline:
                    await self._give_back(reason="memory never came free")
                    raise LeaseError(f"the LLM slept but only {fmt(free)} of the {fmt(needed)} the image needs came "
                                     f"free within {self.config.memory_timeout:.0f} s; something else holds the card")
                await asyncio.sleep(0.5)

    def _release_later(self, job: str) -> None:
        with self.file.locked():
            lease = self.file.read()
            if lease is not None:
                holders = lease.setdefault("holders", {})
                mine = str(os.getpid())
                holders[mine] = holders.get(mine, 1) - 1
                if holders[mine] <= 0:
                    del holders[mine]
                    (lease.get("starts") or {}).pop(mine, None)
                lease["last_job_end"] = time.time()
                self.file.write(lease)
        self.file.event("job-done", job=job)
        self._pending.append(asyncio.get_running_loop().create_task(self._release_when_idle()))

    async def _release_when_idle(self) -> None:
        await asyncio.sleep(self.config.idle)
        async with self._local:
            await self._release_if_idle()

    async def _release_if_idle(self) -> None:
        with self.file.locked():
            lease = self.file.read()
            if lease is None or lease.get("holders") or time.time() - (lease.get("last_job_end") or 0) < \
                    self.config.idle - 0.05:
                return  # another job holds or has renewed the lease; it gives the card back later
            self.file.event("idle")
            await self._give_back(reason="idle")

    async def _give_back(self, reason: str) -> None:
        await give_back_async(self.file, self.backend, self.comfyui, self.config.memory_timeout, reason)

    async def finish(self) -> None:
        """Wait for pending give-backs (a worker about to exit calls this)."""
        if self._pending:
            await asyncio.gather(*self._pending, return_exceptions=True)
            self._pending.clear()


async def give_back_async(file: LeaseFile, backend: str | None, comfyui: str | None, memory_timeout: float,
                          reason: str) -> None:
    """ComfyUI frees its models (polled until the memory is back), then the LLM wakes; the lease ends."""
    async with httpx.AsyncClient(timeout=30) as http:
        if comfyui:
            before = await free_memory(comfyui)
            try:
                await http.post(f"{comfyui}/free", json={"unload_models": True, "free_memory": True})
                file.event("free", reason=reason)
                deadline = time.monotonic() + memory_timeout
                while time.monotonic() < deadline:  # /free only sets a flag: wait until it took effect
                    now_free = await free_memory(comfyui)
                    if before is None or now_free is None or now_free > before:
                        break
                    await asyncio.sleep(0.5)
            except httpx.HTTPError as e:
                file.event("free-failed", error=str(e))
        if backend:
            try:
                await http.post(f"{backend}/wake_up")
                file.event("wake", reason=reason)
            except httpx.HTTPError as e:
                file.event("wake-failed", error=str(e))
                raise LeaseError(f"could not wake the LLM server at {backend}: {e}; `ops health` retries") from None
    file.clear()


def repair(home: Path, llm_url: str | None) -> list[str]:
    """For `ops health`: end a lease that expired or whose holders are gone, and wake a backend left asleep
    with no lease at all. Returns what was repaired."""
    file = LeaseFile(home)
    repaired = []
    with file.locked():
        lease = file.read()
        if lease is not None:
            holders = list(lease.get("holders") or {})
            expired = time.time() > lease.get("expires", 0)
            abandoned = not any(_holder_alive(pid, lease) for pid in holders) and lease.get("last_job_end") is None
            stale = not holders and lease.get("last_job_end") and \
                time.time() - lease["last_job_end"] > 300  # its giver-back died during the idle wait
            if expired or abandoned or stale:
                why = "expired" if expired else "held by processes that are gone"
                asyncio.run(give_back_async(file, lease.get("backend"), lease.get("comfyui"), 30, f"repair: {why}"))
                repaired.append(f"the GPU lease was {why}: ComfyUI freed and the LLM woken")
                return repaired
        if lease is None and llm_url:
            backend = backend_root(llm_url)
            try:
                asleep = httpx.get(f"{backend}/is_sleeping", timeout=5).json().get("is_sleeping")
            except (httpx.HTTPError, ValueError):
                asleep = False
            if asleep:
                httpx.post(f"{backend}/wake_up", timeout=60)
                file.event("wake", reason="repair: asleep without a lease")
                repaired.append(f"the LLM at {backend} was asleep with no lease: woken")
    return repaired


def describe(home: Path) -> dict | None:
    """Who holds the card, for `ops status`."""
    lease = LeaseFile(home).read()
    if lease is None:
        return None
    return {"holder": "comfyui", "llm_asleep": bool(lease.get("asleep")), "since": lease.get("since"),
            "expires": lease.get("expires"), "jobs": sum(lease.get("holders", {}).values())}
