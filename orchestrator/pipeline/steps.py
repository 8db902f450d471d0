"""A run's stored steps, as the stages use them: a step that finished is reused while its files and inputs hold,
and each one done is recorded as a new version of its part, with who did it."""

import json
from collections.abc import Awaitable, Callable
from contextvars import ContextVar
from typing import Literal

from common.files import atomic_write_bytes
from common.settings import Settings
from orchestrator import history
from orchestrator.cancelling import Cancelled
from orchestrator.clients.router import LLMRouter
from orchestrator.history import PIPELINE, Actor
from orchestrator.jobs import JobStore, Step
from orchestrator.pipeline import step_reuse
from orchestrator.pipeline.params import ArticleParams

# The files the step being done has written. Sections are written concurrently, each in its own task, so the
# step a file belongs to is a context variable (tasks and to_thread copy it), not an attribute of the run.
_written: ContextVar[dict[str, dict] | None] = ContextVar("written", default=None)

# When a finished step is done again: "stale" when its files or its inputs changed (the pipeline, resuming);
# "missing" only when its files are gone or changed (an agent's call: a stale input is its choice); "redo" always.
Mode = Literal["stale", "missing", "redo"]


class Reporter:
    """What a person watching sees; the CLI draws progress bars, a background worker reports nothing."""

    def stage(self, name: str, total: int) -> None: ...

    def advance(self, name: str) -> None: ...

    def detail(self, text: str) -> None: ...


class RunSteps:
    """run_id: the run whose parts the steps make; job_id: the job doing them (the run itself for a pipeline,
    a stage job for an agent's call), whose progress and cancel flag they use."""

    def __init__(
        self,
        store: JobStore,
        run_id: str,
        settings: Settings,
        reporter: Reporter | None = None,
        job_id: str | None = None,
        actor: Actor = PIPELINE,
    ):
        self.store = store
        self.run_id = run_id
        self.job_id = job_id or run_id
        self.settings = settings
        self.reporter = reporter or Reporter()
        self.actor = actor
        self.dir = settings.runs_dir / run_id
        self.params = ArticleParams.from_dict(store.get(run_id).params)
        self.llm_urls = [self.params.llm_url] if self.params.llm_url else list(settings.llm_urls)
        self.comfyui_url = self.params.comfyui_url or settings.comfyui_url
        self.lease = None
        self.expected = 0  # steps this job means to do, for its progress (a pipeline counts the run's)
        self.done_here = 0
        self.changed: dict[str, int] = {}  # the parts this job made, and their new versions

    @property
    def total_steps(self) -> int:
        return 1 + self.params.sections + self.params.images + 2

    def llm(self) -> LLMRouter:
        return LLMRouter(
            self.llm_urls,
            model=self.params.model or self.settings.llm_model,
            api_key=self.settings.llm_api_key,
            timeout=self.settings.llm_timeout,
            backoff=self.settings.llm_backoff,
            home=self.settings.home,
        )

    def cancel_requested(self) -> bool:
        return self.store.cancel_requested(self.job_id)

    def reusable(self, name: str, inputs: tuple[str, ...], mode: Mode) -> Step | None:
        """The stored step if it may stand, else None."""
        done = self.store.step(self.run_id, name)
        if mode == "redo" or done is None or done.status not in ("done", "skipped"):
            return None
        consumed = {n: self.store.step(self.run_id, n) for n in inputs} if mode == "stale" else {}
        why = step_reuse.stale_reason(self.dir, done, consumed)
        if why is None:
            return done
        self.store.update(self.job_id, message=f"redoing {name}: {why}")
        return None

    async def step(
        self,
        name: str,
        work: Callable[[], Awaitable[object]],
        inputs: tuple[str, ...] = (),
        mode: Mode = "stale",
        note: str | None = None,
    ) -> object:
        """The step's stored output if it may stand (see Mode), else the output of doing it (again).
        inputs: the steps whose results it consumes; note: the instructions or prompt it is made with."""
        done = self.reusable(name, inputs, mode)
        if done is not None:
            return done.output
        if self.cancel_requested():
            raise Cancelled()
        consumed = {n: s.digest for n in inputs if (s := self.store.step(self.run_id, n)) is not None}
        if name.startswith("illustrate:"):  # texts keep their versions in the history; an image, here
            last = history.latest(self.store, self.run_id, name)
            step_reuse.keep_previous(
                self.dir, name, self.store.step(self.run_id, name), last.version if last else 0
            )
        self.store.start_step(self.run_id, name)
        written: dict[str, dict] = {}
        token = _written.set(written)
        try:
            output = await work()
        except BaseException as e:
            self.store.fail_step(self.run_id, name, describe(e))
            raise
        finally:
            _written.reset(token)
        self.changed[name] = history.commit(
            self.store,
            self.run_id,
            name,
            output,
            written,
            consumed,
            self.actor,
            content=self._content(name, output),
            note=note,
        )
        self._progress(name)
        return output

    def _content(self, name: str, output) -> str | None:
        if name == "research":
            return json.dumps(output)
        if name.startswith("write:") and isinstance(output, str):
            return (self.dir / output).read_text(encoding="utf-8")
        return None

    def _progress(self, name: str) -> None:
        self.done_here += 1
        if self.job_id == self.run_id:
            finished = sum(1 for s in self.store.steps(self.run_id) if s.status in ("done", "skipped"))
            progress = finished / self.total_steps
        else:
            progress = self.done_here / max(self.expected, 1)
        self.store.update(self.job_id, progress=min(progress, 0.99), message=f"{name} done")

    def save(self, relative: str, content: str | bytes) -> str:
        data = content if isinstance(content, bytes) else content.encode()
        # Durable before the step is marked done: a crash never leaves a torn or lost output behind a done step.
        atomic_write_bytes(self.dir / relative, data)
        written = _written.get()
        if written is not None:
            written[relative] = step_reuse.fingerprint(data)
        return relative

    def stage(self, name: str, total: int) -> None:
        self.store.update(self.job_id, stage=name)
        self.reporter.stage(name, total)


def describe(e: BaseException) -> str:
    return str(e) or type(e).__name__
