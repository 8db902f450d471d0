"""Memory leases for image jobs: the LLM lends the card to ComfyUI, and gets it back.

Before an image job, the coordinator compares the memory the job needs with what is free (the GPU
probe, with ComfyUI's /system_stats as a second opinion). If it does not fit, the backend drains
and sleeps (/sleep: KV cache freed, weights moved off the card), the coordinator waits until the
memory is really free, the job runs, and once ComfyUI has been idle for a while it calls ComfyUI's
/free (polling, since /free only sets a flag) and wakes the backend. Leases are serialised across
processes with a file lock (common.lease_file); a job arriving while the card is lent shares the lease.
A lease expires, and `ops health` repairs one whose holders died, so the LLM is never left asleep.
"""

import asyncio
import os
import time
from contextlib import asynccontextmanager

import httpx

from common import backend_client
from common.gpu import fmt
from common.lease_file import EXPIRY, LeaseError, LeaseFile, free_memory, give_back_async, join
from common.settings import Settings

__all__ = ["Coordinator", "LeaseError"]


class Coordinator:
    def __init__(self, settings: Settings, llm_url: str | None, comfyui_url: str):
        self.file = LeaseFile(settings.home)
        self.backend = backend_client.root(llm_url) if llm_url else None
        self.comfyui = comfyui_url
        self.settings = settings
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
        if not self.settings.leases or self.backend is None:
            return False
        with self.file.locked():
            lease = self.file.read()
            if lease is not None and lease.get("asleep"):
                join(lease)
                lease["expires"] = time.time() + EXPIRY
                self.file.write(lease)
                self.file.event("share", job=job)
                return True
            free = await free_memory(self.comfyui)
            if free is None or needed <= free:
                self.file.event("fits", job=job, needed=needed, free=free)
                return False
            api = await self._sleep_api(needed, free, job)
            self.file.event("sleep", job=job, needed=needed, free=free, api=api)
            try:
                async with httpx.AsyncClient(timeout=self.settings.lease_drain_timeout + 30) as http:
                    response = await backend_client.sleep(http, self.backend, self.settings.lease_drain_timeout, api,
                                                          self.settings.llm_api_key)
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
            lease = {"asleep": True, "since": now, "expires": now + EXPIRY, "holders": {},
                     "last_job_end": None, "backend": self.backend, "comfyui": self.comfyui, "sleep_api": api}
            join(lease)
            self.file.write(lease)
            deadline = time.monotonic() + self.settings.lease_memory_timeout
            while True:
                free = await free_memory(self.comfyui)
                if free is None or free >= needed:
                    self.file.event("memory-free", job=job, free=free)
                    lease["lent_free"] = free  # what giving back waits to see free again
                    self.file.write(lease)
                    return True
                if time.monotonic() > deadline:
                    await self._give_back(reason="memory never came free")
                    raise LeaseError(f"the LLM slept but only {fmt(free)} of the {fmt(needed)} the image needs came "
                                     f"free within {self.settings.lease_memory_timeout:.0f} s; something else holds the card")
                await asyncio.sleep(0.5)

    async def _sleep_api(self, needed: int, free: int, job: str) -> str:
        """The backend's sleep API: the setting, or (auto) what the server answers to; none refuses the lease."""
        api, why = self.settings.llm_sleep_api, "SCRIPTORIUM_LLM_SLEEP_API is none"
        if api == "auto":
            async with httpx.AsyncClient(timeout=10) as http:
                api, why = await backend_client.detect(http, self.backend, self.settings.llm_api_key)
        if api == "none":
            self.file.event("refused", job=job, api=api)
            raise LeaseError(f"the image needs {fmt(needed)} of GPU memory but {fmt(free)} is free, and the LLM server "
                             f"at {self.backend} cannot lend its memory ({why}); give ComfyUI a budget that fits beside "
                             "it (x-ops.gpu_memory, --lowvram) or turn on the engine's sleep mode")
        return api

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
        await asyncio.sleep(self.settings.lease_idle)
        async with self._local:
            await self._release_if_idle()

    async def _release_if_idle(self) -> None:
        with self.file.locked():
            lease = self.file.read()
            if lease is None or lease.get("holders") or time.time() - (lease.get("last_job_end") or 0) < \
                    self.settings.lease_idle - 0.05:
                return  # another job holds or has renewed the lease; it gives the card back later
            self.file.event("idle")
            await self._give_back(reason="idle")

    async def _give_back(self, reason: str) -> None:
        await give_back_async(self.file, self.backend, self.comfyui, self.settings.lease_memory_timeout, reason,
                              self.settings.llm_api_key)

    async def finish(self) -> None:
        """Wait for pending give-backs (a worker about to exit calls this)."""
        if self._pending:
            await asyncio.gather(*self._pending, return_exceptions=True)
            self._pending.clear()


