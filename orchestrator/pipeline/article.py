"""Runs the article pipeline as stored steps: every stage in order, with no agent in between; a step that
finished is never redone on resume (unless its files or inputs changed)."""

import asyncio
import json
import os
from pathlib import Path

from common.settings import Settings
from orchestrator.cancelling import Cancelled, unless_cancelled
from orchestrator.clients.comfyui import Interrupted
from orchestrator.pipeline import stages
from orchestrator.pipeline.steps import Reporter, RunSteps, describe

__all__ = ["ArticleRun", "Cancelled", "Reporter", "run_dir"]


class ArticleRun(RunSteps):
    async def execute(self) -> dict:
        self.store.claim(self.run_id, os.getpid())
        self.dir.mkdir(parents=True, exist_ok=True)
        self.save("params.json", json.dumps(self.params.to_dict(), indent=2))
        try:
            result = await unless_cancelled(self.store, self.run_id, self._pipeline())
        except Cancelled:
            self.store.update(
                self.run_id,
                status="cancelled",
                message="cancelled; requests in flight were aborted, steps already done are kept",
            )
            raise
        except Interrupted:
            self.store.update(
                self.run_id, status="cancelled", message="cancelled; the ComfyUI prompt was interrupted"
            )
            raise Cancelled() from None
        except BaseException as e:
            if isinstance(e, (KeyboardInterrupt, asyncio.CancelledError)):
                raise  # the process is going away: the run stays resumable
            self.store.update(self.run_id, status="failed", error=describe(e))
            raise
        self.store.update(
            self.run_id, status="done", progress=1.0, stage="done", result=result, message="done"
        )
        return result

    async def _pipeline(self) -> dict:
        async with self.llm() as llm:
            await stages.research(self, llm)
            await stages.write_sections(self, llm, mode="stale")
            await stages.illustrate(self, llm, mode="stale")
        return await stages.assemble(self)


def run_dir(settings: Settings, run_id: str) -> Path:
    return settings.runs_dir / run_id
