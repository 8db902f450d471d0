"""Runs the article pipeline as stored steps: a step that finished is never redone on resume."""

import asyncio
import json
import os
from collections.abc import Awaitable, Callable
from contextvars import ContextVar
from pathlib import Path

from common.files import atomic_write_bytes
from common.lease import LeaseError
from orchestrator.cancelling import Cancelled, unless_cancelled
from orchestrator.clients.comfyui import ComfyUIClient, ComfyUIError, Interrupted
from orchestrator.clients.llm import LLMRouter
from orchestrator.jobs import JobStore
from orchestrator.pipeline import assembly, outputs
from orchestrator.pipeline.illustration import holding, image_prompt, lease_for, render
from orchestrator.pipeline.params import ArticleParams
from orchestrator.pipeline.research import research
from orchestrator.pipeline.writing import write_section
from orchestrator.settings import Settings
from orchestrator.workflows import TemplateError

# The files the step being done has written. Sections are written concurrently, each in its own task, so the
# step a file belongs to is a context variable (tasks and to_thread copy it), not an attribute of the run.
_written: ContextVar[dict[str, dict] | None] = ContextVar("written", default=None)


class Reporter:
    """What a person watching sees; the CLI draws progress bars, a background worker reports nothing."""

    def stage(self, name: str, total: int) -> None: ...

    def advance(self, name: str) -> None: ...

    def detail(self, text: str) -> None: ...


class ArticleRun:
    def __init__(self, store: JobStore, run_id: str, settings: Settings, reporter: Reporter | None = None):
        self.store = store
        self.run_id = run_id
        self.settings = settings
        self.reporter = reporter or Reporter()
        run = store.get(run_id)
        self.params = ArticleParams.from_dict(run.params)
        self.dir = settings.runs_dir / run_id
        self.total_steps = 1 + self.params.sections + self.params.images + 2
        self.llm_urls = [self.params.llm_url] if self.params.llm_url else list(settings.llm_urls)
        self.comfyui_url = self.params.comfyui_url or settings.comfyui_url
        self.lease = None

    def _cancel_requested(self) -> bool:
        return self.store.cancel_requested(self.run_id)

    async def step(self, name: str, work: Callable[[], Awaitable[object]], inputs: tuple[str, ...] = ()) -> object:
        """The step's stored output if its files and inputs still hold, else the output of doing it (again).
        inputs: the steps whose results it consumes; one of them redone differently makes this one stale."""
        done = self.store.step(self.run_id, name)
        if done is not None and done.status in ("done", "skipped"):
            why = outputs.stale_reason(self.dir, done, {n: self.store.step(self.run_id, n) for n in inputs})
            if why is None:
                return done.output
            self.store.update(self.run_id, message=f"redoing {name}: {why}")
        if self._cancel_requested():
            raise Cancelled()
        consumed = {n: s.digest for n in inputs if (s := self.store.step(self.run_id, n)) is not None}
        self.store.start_step(self.run_id, name)
        written: dict[str, dict] = {}
        token = _written.set(written)
        try:
            output = await work()
        except BaseException as e:
            self.store.fail_step(self.run_id, name, _describe(e))
            raise
        finally:
            _written.reset(token)
        self.store.finish_step(self.run_id, name, output, files=written, inputs=consumed)
        finished = sum(1 for s in self.store.steps(self.run_id) if s.status in ("done", "skipped"))
        self.store.update(self.run_id, progress=min(finished / self.total_steps, 0.99), message=f"{name} done")
        return output

    def _save(self, relative: str, content: str | bytes) -> str:
        data = content if isinstance(content, bytes) else content.encode()
        # Durable before the step is marked done: a crash never leaves a torn or lost output behind a done step.
        atomic_write_bytes(self.dir / relative, data)
        written = _written.get()
        if written is not None:
            written[relative] = outputs.fingerprint(data)
        return relative

    async def execute(self) -> dict:
        self.store.claim(self.run_id, os.getpid())
        self.dir.mkdir(parents=True, exist_ok=True)
        self._save("params.json", json.dumps(self.params.to_dict(), indent=2))
        try:
            result = await unless_cancelled(self.store, self.run_id, self._pipeline())
        except Cancelled:
            self.store.update(self.run_id, status="cancelled",
                              message="cancelled; requests in flight were aborted, steps already done are kept")
            raise
        except Interrupted:
            self.store.update(self.run_id, status="cancelled", message="cancelled; the ComfyUI prompt was interrupted")
            raise Cancelled() from None
        except BaseException as e:
            if isinstance(e, (KeyboardInterrupt, asyncio.CancelledError)):
                raise  # the process is going away: the run stays resumable
            self.store.update(self.run_id, status="failed", error=_describe(e))
            raise
        self.store.update(self.run_id, status="done", progress=1.0, stage="done", result=result, message="done")
        return result

    async def _pipeline(self) -> dict:
        p = self.params
        async with LLMRouter(self.llm_urls, model=p.model or self.settings.llm_model, api_key=self.settings.llm_api_key,
                             timeout=self.settings.llm_timeout) as llm:
            self._stage("research", 1)
            outline = await self.step("research", lambda: self._research(llm))
            self.reporter.advance("research")

            self._stage("writing", p.sections)

            async def write(i: int) -> str:
                relative = await self.step(f"write:{i:02d}", lambda: self._write(llm, outline, i), ("research",))
                self.reporter.advance("writing")
                return (self.dir / relative).read_text(encoding="utf-8")

            texts = await asyncio.gather(*(write(i) for i in range(p.sections)))

            self._stage("illustration", p.images)
            images, notes = {}, []
            comfyui = ComfyUIClient(self.comfyui_url, self.settings.comfyui_timeout) if self.comfyui_url else None
            self.lease = lease_for(self.settings, self.comfyui_url, self.llm_urls[0])
            try:
                for i in range(p.images):
                    out = await self.step(f"illustrate:{i:02d}", lambda i=i: self._illustrate(llm, comfyui, outline, i),
                                          ("research",))
                    self.reporter.advance("illustration")
                    if out.get("file"):
                        images[i] = out
                    elif out.get("skipped") and out["skipped"] not in notes:
                        notes.append(out["skipped"])
            finally:
                if comfyui is not None:
                    await comfyui.aclose()
                if self.lease is not None:  # gives the card back to the LLM once ComfyUI is idle
                    await self.lease.finish()

        note = f"Images skipped: {'; '.join(notes)}" if notes else None
        self._stage("assembly", 2)
        written = tuple(f"write:{i:02d}" for i in range(p.sections))
        illustrated = tuple(f"illustrate:{i:02d}" for i in range(p.images))
        assembled = await self.step("assemble", lambda: self._assemble(outline, texts, images, note),
                                    ("research", *written, *illustrated))
        self.reporter.advance("assembly")
        post = await self.step("postprocess", lambda: asyncio.to_thread(
            assembly.postprocess, self.dir, [images[i]["file"] for i in sorted(images)], self._save), illustrated)
        self.reporter.advance("assembly")
        return {
            "run_dir": str(self.dir), "title": outline["title"],
            "article_md": str(self.dir / assembled["markdown"]), "article_html": str(self.dir / assembled["html"]),
            "images": [str(self.dir / images[i]["file"]) for i in sorted(images)],
            "images_skipped": note, "postprocess": post,
            "thumbnail": str(self.dir / post["thumbnail"]) if post.get("thumbnail") else None,
            "excerpt": texts[0][:300] if texts else "",
        }

    def _stage(self, name: str, total: int) -> None:
        self.store.update(self.run_id, stage=name)
        self.reporter.stage(name, total)

    async def _research(self, llm: LLMRouter) -> dict:
        outline = await research(llm, self.params, structured=self.settings.llm_structured_output)
        self._save("research.json", json.dumps(outline, indent=2))
        return outline

    async def _write(self, llm: LLMRouter, outline: dict, i: int) -> str:
        return self._save(f"sections/{i:02d}.md", await write_section(llm, outline, i, self.params))

    async def _illustrate(self, llm: LLMRouter, comfyui: ComfyUIClient | None, outline: dict, i: int) -> dict:
        if comfyui is None:
            return {"skipped": "ComfyUI is not configured (set SCRIPTORIUM_COMFYUI_URL or pass --comfyui)"}
        prompt = await image_prompt(llm, outline, i, self.params)
        self._save(f"images/{i:02d}.prompt.txt", prompt)

        def progress(event: dict) -> None:
            if event.get("max"):
                self.reporter.detail(f"image {i + 1}: step {event['value']}/{event['max']}")

        try:
            async with holding(self.lease, self.params.template, f"{self.run_id}/illustrate:{i:02d}"):
                png = await render(comfyui, prompt, self.params, i, progress, self._cancel_requested,
                                   {"scriptorium_job": self.run_id})
        except Interrupted:
            raise
        except (ComfyUIError, TemplateError, LeaseError) as e:  # the article still completes, saying why
            return {"skipped": str(e), "prompt": prompt}
        return {"file": self._save(f"images/{i:02d}.png", png), "prompt": prompt}

    async def _assemble(self, outline: dict, texts: list[str], images: dict, note: str | None) -> dict:
        md = assembly.article_markdown(outline, texts, images)
        page = assembly.article_html(outline, texts, images, self.dir, note)
        return {"markdown": self._save("article.md", md), "html": self._save("article.html", page)}


def _describe(e: BaseException) -> str:
    return str(e) or type(e).__name__


def run_dir(settings: Settings, run_id: str) -> Path:
    return settings.runs_dir / run_id
