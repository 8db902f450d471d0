"""What ops does with the GPU lease (common.lease_file): `ops status` says who holds the card, `ops health`
repairs a lease whose holders died or that expired, and wakes an LLM left asleep without one. Image jobs
take leases through orchestrator.image_lease."""

import asyncio
import time
from pathlib import Path

from common import backend_client
from common.lease_file import LeaseError, LeaseFile, give_back_async, holder_alive

__all__ = ["LeaseError", "LeaseFile", "describe", "repair"]


def repair(home: Path, llm_url: str | None, api_key: str | None = None) -> list[str]:
    """For `ops health`: end a lease that expired or whose holders are gone, and wake a backend left asleep
    with no lease at all, sending api_key (SCRIPTORIUM_LLM_API_KEY) to a server that wants one. Returns what
    was repaired."""
    file = LeaseFile(home)
    repaired = []
    with file.locked():
        lease = file.read()
        if lease is not None:
            holders = list(lease.get("holders") or {})
            expired = time.time() > lease.get("expires", 0)
            abandoned = not any(holder_alive(pid, lease) for pid in holders) and lease.get("last_job_end") is None
            stale = not holders and lease.get("last_job_end") and \
                time.time() - lease["last_job_end"] > 300  # its giver-back died during the idle wait
            if expired or abandoned or stale:
                why = "expired" if expired else "held by processes that are gone"
                asyncio.run(give_back_async(file, lease.get("backend"), lease.get("comfyui"), 30, f"repair: {why}",
                                             api_key))
                repaired.append(f"the GPU lease was {why}: ComfyUI freed and the LLM woken")
                return repaired
        if lease is None and llm_url:
            backend = backend_client.root(llm_url)
            if backend_client.is_sleeping(backend, api_key=api_key):
                backend_client.wake_up_now(backend, api_key=api_key)
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
