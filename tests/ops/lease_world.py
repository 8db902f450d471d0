"""The world memory-lease tests run in: a simulated card that follows the LLM and ComfyUI, the lease events, and
an image job."""

import asyncio
import json
import threading
import time

import httpx

from common.settings import Settings
from orchestrator.jobs import JobStore
from orchestrator.pipeline.image import run_image

GIB = 2**30


class SimulatedCard:
    """Writes the probe file the way a driver would report it: the LLM holds its memory unless asleep,
    ComfyUI holds its model while one is loaded."""

    def __init__(self, path, backend: str, comfyui: str, total: float, llm: float, image: float = 4.0,
                 asleep=None):
        self.path, self.backend, self.comfyui = path, backend, comfyui
        # whether the LLM's memory is off the card: our backend's and vLLM's /is_sleeping by default
        self.asleep = asleep or (lambda: httpx.get(f"{self.backend}/is_sleeping", timeout=2).json()["is_sleeping"])
        self.total, self.llm, self.image = total, llm, image
        self.peak_used = 0.0  # above total: the LLM woke while ComfyUI still held its model
        self.stop = threading.Event()
        self.lock = threading.Lock()  # a test may write() while the thread does: one temp file at a time
        self.write()
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def write(self):
        try:
            asleep = self.asleep()
            loaded = httpx.get(f"{self.comfyui}/_test/state", timeout=2).json()["loaded"]
        except (httpx.HTTPError, ValueError, KeyError):
            return
        used = (0 if asleep else self.llm) + (self.image if loaded else 0)
        self.peak_used = max(self.peak_used, used)
        with self.lock:
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text(json.dumps([{"index": 0, "name": "RTX 4090", "total": int(self.total * GIB),
                                        "free": int((self.total - used) * GIB), "processes": []}]))
            tmp.replace(self.path)

    def run(self):
        while not self.stop.is_set():
            self.write()
            time.sleep(0.1)

    def close(self):
        self.stop.set()
        self.thread.join()


def events(settings: Settings) -> list[str]:
    path = settings.home / "state" / "lease-events.log"
    return [json.loads(line)["event"] for line in path.read_text().splitlines()] if path.exists() else []


def render(settings: Settings) -> dict:
    store = JobStore(settings.jobs_db)
    run = store.create_run("image", {"prompt": "a quill", "steps": 3})
    return asyncio.run(run_image(store, run.id, settings))
