"""A stage job: one stage (research, write_section, write_sections, illustrate, assemble) done on a shared run
for one caller. It is a job of its own (kind "stage"), so it has progress, can be cancelled and outlives the call
that started it, while its parts land in the run it names, with the caller recorded in the run's history."""

import asyncio
import os
from dataclasses import asdict, dataclass, field

from common.settings import Settings
from orchestrator import history
from orchestrator.cancelling import Cancelled, unless_cancelled
from orchestrator.clients.comfyui import Interrupted
from orchestrator.history import Actor
from orchestrator.jobs import JobStore
from orchestrator.pipeline import stages
from orchestrator.pipeline.params import ParamsError, from_fields
from orchestrator.pipeline.steps import Reporter, RunSteps, describe

STAGES = ("research", "write_section", "write_sections", "illustrate", "assemble")
ARGS = {
    "research": {"instructions", "redo"},
    "write_section": {"index", "instructions", "redo"},
    "write_sections": {"redo"},
    "illustrate": {"index", "prompt", "template", "checkpoint", "redo"},
    "assemble": {"formats", "post_process"},
}
FORMATS = ("md", "html")


@dataclass
class StageParams:
    run_id: str
    stage: str
    args: dict = field(default_factory=dict)
    client: str = "cli"
    tool: str = ""

    def __post_init__(self) -> None:
        if self.stage not in STAGES:
            raise ParamsError(f"unknown stage {self.stage!r}; the stages are {', '.join(STAGES)}")
        unknown = sorted(set(self.args) - ARGS[self.stage])
        if unknown:
            raise ParamsError(f"{self.stage} takes no {', '.join(unknown)}")
        if self.stage == "write_section" and not isinstance(self.args.get("index"), int):
            raise ParamsError("write_section needs the index of the section (0 for the first)")
        formats = self.args.get("formats", list(FORMATS))
        if self.stage == "assemble" and (not formats or any(f not in FORMATS for f in formats)):
            raise ParamsError(f"formats must be some of {', '.join(FORMATS)}, got {formats}")
        self.tool = self.tool or self.stage

    @classmethod
    def from_dict(cls, data: dict) -> "StageParams":
        return from_fields(cls, data, "stage")

    def to_dict(self) -> dict:
        return asdict(self)


async def _do(run: RunSteps, stage: str, args: dict) -> dict | None:
    """The stage's work; returns the assembled article's summary for assemble, else None."""
    again = "redo" if args.get("redo") else None
    if stage == "assemble":
        result = await stages.assemble(
            run, tuple(args.get("formats", FORMATS)), args.get("post_process", True)
        )
        run.store.update(run.run_id, result=result)
        return result
    async with run.llm() as llm:
        if stage == "research":
            run.expected = 1
            await stages.research(run, llm, args.get("instructions"), again or "stale")
        elif stage == "write_section":
            run.expected = 1
            await stages.write_section(run, llm, args["index"], args.get("instructions"), again or "stale")
        elif stage == "write_sections":
            await stages.write_sections(run, llm, again or "missing")
        else:
            one = args.get("index") is not None
            await stages.illustrate(
                run,
                llm,
                args.get("index"),
                args.get("prompt"),
                args.get("template"),
                args.get("checkpoint"),
                again or ("stale" if one else "missing"),
            )
    return None


async def run_stage(
    store: JobStore, job_id: str, settings: Settings, reporter: Reporter | None = None
) -> dict:
    """Do the stage job; its result names the parts it changed and their new versions."""
    store.claim(job_id, os.getpid())
    params = StageParams.from_dict(store.get(job_id).params)
    try:
        run = RunSteps(
            store, params.run_id, settings, reporter, job_id=job_id, actor=Actor(params.client, params.tool)
        )
        run.dir.mkdir(parents=True, exist_ok=True)
        article = await unless_cancelled(store, job_id, _do(run, params.stage, params.args))
    except Cancelled:
        store.update(job_id, status="cancelled", message="cancelled; the parts already done are kept")
        raise
    except Interrupted:
        store.update(job_id, status="cancelled", message="cancelled; the ComfyUI prompt was interrupted")
        raise Cancelled() from None
    except BaseException as e:
        if isinstance(e, (KeyboardInterrupt, asyncio.CancelledError)):
            raise  # the process is going away: calling the stage again finishes what is missing
        store.update(job_id, status="failed", error=describe(e))
        raise
    changed = [{"part": p, "what": history.describe(p), "version": v} for p, v in sorted(run.changed.items())]
    said = ", ".join(f"{c['what']} (version {c['version']})" for c in changed) or "nothing: every part stands"
    result = {
        "run_id": run.run_id,
        "stage": params.stage,
        "changed": changed,
        "article": article,
        "summary": f"{params.stage} changed {said}",
    }
    store.update(job_id, status="done", progress=1.0, stage="done", result=result, message=result["summary"])
    return result
