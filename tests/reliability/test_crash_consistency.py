"""kill -9 the article worker at seeded random points, and the backend once, damage finished outputs, resume:
the run finishes, each section is in the article exactly once, the database is intact, the damage is redone.

A kill point is "step S has started (or is done), then a random delay", read from the job store, so a seed gives
the same points whatever the machine's speed; ComfyUI hangs until the end, so no kill comes after the run is done.
CRASH_SEED=N picks other points.
"""

import os
import random
import signal
import sqlite3
import time
from pathlib import Path

import pytest

from common.procs import pid_alive
from common.settings import Settings
from orchestrator import api
from orchestrator.jobs import JobStore
from orchestrator.pipeline import assembly, step_reuse
from tests.backend.server_process import ServerProcess, free_port
from tests.serving import wait_for

SEED = int(os.environ.get("CRASH_SEED", "15"))
SECTIONS, IMAGES = 3, 1
STEPS = ["research", *(f"write:{i:02d}" for i in range(SECTIONS)), "illustrate:00", "assemble", "postprocess"]
# In pipeline order, up to the render, which hangs: each kill lands on a live worker. The sections are written
# concurrently, so their events are counts.
EVENTS = [("research", "started"), ("research", "done"), *(("writes", n) for n in range(1, SECTIONS + 1)),
          ("illustrate:00", "started")]
BACKEND_BEFORE = 2  # the backend goes down once, before the first kill at a write event

class Backend:
    """The real backend on a port of its own, which the test may kill -9 and start again on that port."""

    def __init__(self, model: Path):
        self.model, self.port = model, free_port()
        self.server = self._start()

    def _start(self) -> ServerProcess:
        return ServerProcess(str(self.model), "--served-model-name", "tiny", "--max-num-seqs", "16", port=self.port)

    @property
    def url(self) -> str:
        return self.server.url

    def kill_and_restart(self) -> None:
        os.killpg(self.server.proc.pid, signal.SIGKILL)
        self.server.proc.wait(timeout=30)
        self.server = self._start()

    def stop(self) -> None:
        self.server.stop()


@pytest.fixture
def backend(tmp_path_factory):
    from tests.backend.tiny_models import build_model

    model = build_model("llama", tmp_path_factory.mktemp("crash-model") / "tiny", max_position_embeddings=4096)
    server = Backend(model)
    yield server
    server.stop()


def reached(store: JobStore, run_id: str, event: tuple) -> bool:
    steps = {s.name: s for s in store.steps(run_id)}
    name, what = event
    if name == "writes":
        return sum(1 for n, s in steps.items() if n.startswith("write:") and s.status == "done") >= what
    return name in steps and (what == "started" or steps[name].status == "done")


def writing(store: JobStore, run_id: str) -> bool:
    """Sections are being written (requests in flight), or all of them are done."""
    steps = [s for s in store.steps(run_id) if s.name.startswith("write:")]
    return any(s.status == "running" for s in steps) or reached(store, run_id, ("writes", SECTIONS))


def kill_worker(store: JobStore, run_id: str) -> None:
    pid = store.get(run_id).pid
    os.kill(pid, signal.SIGKILL)
    wait_for(lambda: not pid_alive(pid), timeout=30, interval=0.02)


def ensure_worker(store: JobStore, run_id: str, settings: Settings) -> None:
    """A worker on the run: the one still going (after a backend restart it retries), or a new one."""
    api.resume(run_id, settings)


def test_kill_9_anywhere_then_resume_finishes_one_consistent_article(tmp_path, backend, comfyui):
    rng = random.Random(SEED)
    # Each event once, so each kill comes the first time the pipeline gets there (then a delay); five of them,
    # and the render always, so that every section is written before the damage below.
    points = sorted((event, rng.uniform(0, 0.3)) for event in rng.sample(range(len(EVENTS) - 1), len(EVENTS) - 2))
    points.append((len(EVENTS) - 1, rng.uniform(0, 0.3)))
    settings = Settings(home=tmp_path / "home", llm_urls=(f"{backend.url}/v1",), comfyui_url=comfyui.url)
    store = JobStore(settings.jobs_db)
    comfyui.behave(hang=True)
    run = api.start_article({"topic": "ink and paper", "sections": SECTIONS, "images": IMAGES,
                             "words_per_section": 30, "seed": SEED}, settings)

    backend_killed = False
    for event, delay in points:
        ensure_worker(store, run.id, settings)
        if event >= BACKEND_BEFORE and not backend_killed:
            # Requests in flight die with it; the worker retries until the restarted backend answers.
            wait_for(lambda: writing(store, run.id), interval=0.01)
            backend.kill_and_restart()
            backend_killed = True
        wait_for(lambda event=EVENTS[event]: reached(store, run.id, event), interval=0.01)
        time.sleep(delay)
        assert store.get(run.id).status not in ("done", "cancelled") and store.get(run.id).worker_alive
        kill_worker(store, run.id)
    assert backend_killed and len(points) >= 5

    # Damage two finished outputs: a section deleted, another output torn to half its size.
    done = [s for s in store.steps(run.id) if s.status == "done"]
    deleted = rng.choice([s for s in done if s.name.startswith("write:")])
    torn = rng.choice([s for s in done if s is not deleted])
    (settings.runs_dir / run.id / deleted.output).unlink()
    path = settings.runs_dir / run.id / rng.choice(sorted(torn.files))
    path.write_bytes(path.read_bytes()[:path.stat().st_size // 2])
    damaged = {deleted.name: deleted.started, torn.name: torn.started}

    comfyui.behave()
    ensure_worker(store, run.id, settings)
    final = wait_for(lambda: (r := store.get(run.id)).status in ("done", "failed", "cancelled") and r, timeout=120)
    assert final.status == "done", final.error

    steps = {s.name: s for s in store.steps(run.id)}
    assert sorted(steps) == sorted(STEPS) and {s.status for s in steps.values()} == {"done"}
    for name, started in damaged.items():
        assert steps[name].started != started, f"{name} was damaged but not redone"
    run_dir = settings.runs_dir / run.id
    for step in steps.values():  # every output is what its step recorded
        for relative, recorded in step.files.items():
            assert step_reuse.file_problem(run_dir, relative, recorded) is None

    outline = steps["research"].output
    texts = [(run_dir / steps[f"write:{i:02d}"].output).read_text() for i in range(SECTIONS)]
    images = {0: steps["illustrate:00"].output}
    md = (run_dir / "article.md").read_text()
    assert md == assembly.article_markdown(outline, texts, images)  # assembled from the final sections
    assert md.count("\n## ") == SECTIONS
    for text in texts:
        assert md.count(text.strip()) == 1
    page = (run_dir / "article.html").read_text()
    assert page.count("<h2>") == SECTIONS and page.count('src="data:image/png;base64,') == IMAGES

    with sqlite3.connect(settings.jobs_db) as db:
        assert db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
