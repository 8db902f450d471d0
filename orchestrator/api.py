"""The orchestrator's Python API (the MCP server calls it): start, follow, cancel and list runs.

A run started here is worked on by its own detached process (`python -m orchestrator work ID`),
so it outlives the caller; its state lives in SQLite and its files in the run directory. Article and
stage jobs share a bounded pool of such workers (orchestrator/pool.py): the ones over its size wait,
queued. Ids are exact here: a prefix names no run.
"""

import os
import time
from pathlib import Path

from common.settings import Settings
from orchestrator import pool, run_edits, run_view
from orchestrator.history import Actor, VersionConflict
from orchestrator.job_pages import page  # noqa: F401 (the API's listing)
from orchestrator.jobs import JobError, JobStore, Run, StoreError, UnknownRun
from orchestrator.pipeline.image import ImageParams, build_workflow
from orchestrator.pipeline.params import LENGTHS, ArticleParams, ParamsError
from orchestrator.pipeline.stage_job import StageParams
from orchestrator.pool import QueueFull, spawn_worker
from orchestrator.run_edits import EditError
from orchestrator.workflows import TemplateError

__all__ = ["Actor", "EditError", "JobError", "ParamsError", "QueueFull", "Run", "StoreError", "TemplateError",
           "VersionConflict", "cancel",
           "create_article_run", "create_run", "create_stage_job", "get", "get_run", "image_workflow", "list_runs",
           "outline_schema", "page", "reject_section", "resume", "set_image", "set_outline", "set_section", "spawn_worker",
           "start_article", "start_image", "start_stage", "status", "UnknownRun", "wait_settled"]


def store_for(settings: Settings) -> JobStore:
    return JobStore(settings.jobs_db)


def create_article_run(params: dict, settings: Settings, client: str = "api") -> Run:
    """An article job in the queue (the next dispatch starts it when a worker is free)."""
    validated = ArticleParams.from_dict(params)  # refuse bad input before anything is stored
    return store_for(settings).create_run("article", validated.to_dict(), client=client)


def image_workflow(params: dict) -> dict:
    """The ComfyUI workflow an image job with these parameters would submit; ParamsError or TemplateError
    saying what is wrong with them."""
    return build_workflow(ImageParams.from_dict(params))[0]


def start_image(params: dict, settings: Settings | None = None, client: str = "api") -> Run:
    """An image job: started at once when a worker is free, else queued (QueueFull past the client's cap)."""
    settings = settings or Settings.from_env()
    validated = ImageParams.from_dict(params)
    return pool.enqueue(store_for(settings), "image", validated.to_dict(), settings, client)


def start_article(params: dict, settings: Settings | None = None, client: str = "api") -> Run:
    """An article job: started at once when a worker is free, else queued (QueueFull past the client's cap)."""
    settings = settings or Settings.from_env()
    validated = ArticleParams.from_dict(params)
    return pool.enqueue(store_for(settings), "article", validated.to_dict(), settings, client)


def resume(run_id: str, settings: Settings | None = None) -> Run:
    """Continue a failed or interrupted run: it joins the back of the queue."""
    settings = settings or Settings.from_env()
    store = store_for(settings)
    run = store.get(run_id)
    if run.status in ("done", "cancelled") or run.status in ("queued", "running") and run.worker_alive:
        return get(run.id, settings)  # finished, or already being worked on
    if run.status != "queued":
        store.update(run.id, status="queued", pid=None, error=None, queued_at=time.time())
    pool.dispatch(store, settings)
    return get(run.id, settings)


def status(run_id: str, settings: Settings | None = None) -> dict:
    settings = settings or Settings.from_env()
    store = store_for(settings)
    run = get(run_id, settings)
    return {**run.to_dict(), "steps": [s.to_dict() for s in store.steps(run.id)]}


def cancel(run_id: str, settings: Settings | None = None) -> Run:
    settings = settings or Settings.from_env()
    return store_for(settings).request_cancel(run_id)


def get(run_id: str, settings: Settings | None = None) -> Run:
    """The run with exactly this id (with its queue position while it waits). Looking moves the queue on, as a
    listing does: an agent polling its queued job is what starts it when nothing else would."""
    settings = settings or Settings.from_env()
    store = store_for(settings)
    run = store.get(run_id)
    pool.settle(store, settings)
    return pool.placed([store.get(run.id)], store)[0]


def wait_settled(run_id: str, settings: Settings, timeout: float = 5.0) -> Run:
    """The run once it is done, failed or cancelled, or as it stands after `timeout` seconds."""
    store = store_for(settings)
    deadline = time.monotonic() + timeout
    run = store.get(run_id)
    while run.status in ("queued", "running") and not run.interrupted and time.monotonic() < deadline:
        time.sleep(0.1)
        run = store.get(run_id)
    return run


# Shared runs: a workspace several agents (or people) each do a stage of ---------------------------------------

def create_run(params: dict, settings: Settings | None = None) -> Run:
    """A shared article run, open for its stages; `length` (short, medium, long) sets sections and words."""
    settings = settings or Settings.from_env()
    params = dict(params)
    length = params.pop("length", None)
    if length is not None:
        if length not in LENGTHS:
            raise ParamsError(f"length must be one of {', '.join(LENGTHS)}, got {length!r}")
        sections, words = LENGTHS[length]
        params.setdefault("sections", sections)
        params.setdefault("words_per_section", words)
        params.setdefault("images", min(2, params["sections"]))
    validated = ArticleParams.from_dict(params)
    return store_for(settings).create_run("article", validated.to_dict(), status="open")


def get_run(run_id: str, settings: Settings | None = None) -> dict:
    settings = settings or Settings.from_env()
    return run_view.view(store_for(settings), settings, run_id)


def outline_schema() -> dict:
    """The JSON schema set_outline checks an outline against."""
    return run_edits.edit_schema()


def set_outline(run_id: str, outline: dict, expected_version: int, actor: Actor,
                settings: Settings | None = None) -> int:
    settings = settings or Settings.from_env()
    return run_edits.set_outline(store_for(settings), settings, run_id, outline, expected_version, actor)


def set_section(run_id: str, index: int, text: str, expected_version: int, actor: Actor,
                settings: Settings | None = None) -> int:
    settings = settings or Settings.from_env()
    return run_edits.set_section(store_for(settings), settings, run_id, index, text, expected_version, actor)


def reject_section(run_id: str, index: int, reason: str, actor: Actor, expected_version: int | None = None,
                   settings: Settings | None = None) -> int:
    settings = settings or Settings.from_env()
    return run_edits.reject_section(store_for(settings), run_id, index, reason, expected_version, actor)


def set_image(run_id: str, index: int, path: Path, actor: Actor, prompt: str | None = None,
              expected_version: int | None = None, settings: Settings | None = None) -> int:
    settings = settings or Settings.from_env()
    return run_edits.set_image(store_for(settings), settings, run_id, index, path, prompt, expected_version, actor)


def stage_params(run_id: str, stage: str, args: dict, actor: Actor, settings: Settings) -> StageParams:
    run = run_edits.article_run(store_for(settings), run_id)
    return StageParams(run.id, stage, {k: v for k, v in args.items() if v is not None}, actor.client, actor.tool)


def create_stage_job(run_id: str, stage: str, args: dict, actor: Actor, settings: Settings) -> Run:
    """The job of one stage on a shared run, done by this process in the foreground (the CLI): it holds no
    worker's place, so the pool never starts it elsewhere."""
    params = stage_params(run_id, stage, args, actor, settings)
    return store_for(settings).create_run("stage", params.to_dict(), status="running", client=actor.client,
                                          pid=os.getpid())


def start_stage(run_id: str, stage: str, args: dict, actor: Actor, settings: Settings | None = None) -> Run:
    """Do one stage on a shared run in a worker of the pool (queued while none is free); follow the returned
    job like any other."""
    settings = settings or Settings.from_env()
    params = stage_params(run_id, stage, args, actor, settings)
    return pool.enqueue(store_for(settings), "stage", params.to_dict(), settings, actor.client)


def list_runs(limit: int = 50, settings: Settings | None = None) -> list[dict]:
    settings = settings or Settings.from_env()
    store = store_for(settings)
    pool.settle(store, settings)
    return [r.to_dict() for r in pool.placed(store.recent(limit), store)]
