"""The article's stages as functions over a run's stored steps: research, write_section(s), illustrate, assemble.
The pipeline calls them in order; an agent calls any of them on a shared run. Each is safe to call again: what
stands is reused (see steps.Mode), and instructions that differ from those a part was made with make it anew."""

import asyncio
import json

from common.lease_file import LeaseError
from orchestrator import history
from orchestrator.clients.comfyui import ComfyUIClient, ComfyUIError, Interrupted
from orchestrator.clients.completion_budget import context_window
from orchestrator.clients.router import LLMRouter
from orchestrator.pipeline import assembly, writing
from orchestrator.pipeline import research as researching
from orchestrator.pipeline.illustration import holding, image_prompt, lease_for, render
from orchestrator.pipeline.steps import Mode, RunSteps
from orchestrator.workflows import TemplateError

NO_COMFYUI = "ComfyUI is not configured (set SCRIPTORIUM_COMFYUI_URL or pass --comfyui)"


class StageError(Exception):
    """A stage asked for before what it needs is there (a section before the outline, assembly before sections)."""


def section_step(index: int) -> str:
    return f"write:{index:02d}"


def image_step(index: int) -> str:
    return f"illustrate:{index:02d}"


def _mode(run: RunSteps, name: str, note: str | None, mode: Mode) -> Mode:
    """Instructions other than those the stored part was made with call for a new one."""
    if note is None or mode == "redo":
        return mode
    last = history.latest(run.store, run.run_id, name)
    return mode if last is not None and last.note == note else "redo"


def outline_of(run: RunSteps) -> dict:
    step = run.store.step(run.run_id, "research")
    if step is None or step.status not in ("done", "skipped") or not isinstance(step.output, dict):
        raise StageError(f"run {run.run_id} has no outline yet: call research (or set_outline) first")
    return step.output


def _check_index(run: RunSteps, index: int, outline: dict, what: str) -> None:
    if not 0 <= index < len(outline["sections"]):
        raise StageError(
            f"{what} {index} does not exist: the outline has sections 0 to {len(outline['sections']) - 1}"
        )


async def research(
    run: RunSteps, llm: LLMRouter, instructions: str | None = None, mode: Mode = "stale"
) -> dict:
    run.stage("research", 1)

    async def work() -> dict:
        outline = await researching.research(
            llm, run.params, run.settings.llm_structured_output, instructions
        )
        run.save("research.json", json.dumps(outline, indent=2))
        return outline

    outline = await run.step(
        "research", work, mode=_mode(run, "research", instructions, mode), note=instructions
    )
    run.reporter.advance("research")
    return outline


async def write_section(
    run: RunSteps, llm: LLMRouter, index: int, instructions: str | None = None, mode: Mode = "stale"
) -> str:
    """The section's text, written unless what is stored stands. A rejected section is rewritten, from the
    rejection's reason unless other instructions are given."""
    outline = outline_of(run)
    _check_index(run, index, outline, "section")
    name = section_step(index)
    reason = rejection(run, index)
    if reason is not None:
        mode, instructions = "redo", instructions or reason

    async def work() -> str:
        window = await context_window(llm)
        words = writing.section_words(run.params, len(outline["sections"]), window)

        def guarded(note: str) -> None:
            history.remark(run.store, run.run_id, f"loop_guard:{index:02d}", "", history.PIPELINE, note)

        text = await writing.write_section(llm, outline, index, run.params, instructions, words, guarded)
        return run.save(f"sections/{index:02d}.md", text)

    relative = await run.step(
        name, work, ("research",), _mode(run, name, instructions, mode), note=instructions
    )
    run.reporter.advance("writing")
    return (run.dir / relative).read_text(encoding="utf-8")


def rejection(run: RunSteps, index: int) -> str | None:
    """Why the section as it stands was rejected (reject_section), or None."""
    review = history.latest(run.store, run.run_id, f"review:{index:02d}")
    step = run.store.step(run.run_id, section_step(index))
    if review is None or step is None or step.status != "done" or review.digest != step.digest:
        return None
    return review.note


async def write_sections(run: RunSteps, llm: LLMRouter, mode: Mode = "missing") -> list[str]:
    """Every section, concurrently (the backend batches them); mode "missing": only those not yet written (or
    rejected)."""
    count = len(outline_of(run)["sections"])
    run.stage("writing", count)
    run.expected = sum(1 for i in range(count) if run.reusable(section_step(i), ("research",), mode) is None)
    return list(await asyncio.gather(*(write_section(run, llm, i, mode=mode) for i in range(count))))


async def illustrate(
    run: RunSteps,
    llm: LLMRouter,
    index: int | None = None,
    prompt: str | None = None,
    template: str | None = None,
    checkpoint: str | None = None,
    mode: Mode = "missing",
) -> dict[int, dict]:
    """One image (index) or those of the first params.images sections, each rendered with the memory lease;
    {index: {"file", "prompt"} or {"skipped": why}}."""
    outline = outline_of(run)
    if index is not None:
        _check_index(run, index, outline, "image")
    indices = [index] if index is not None else list(range(min(run.params.images, len(outline["sections"]))))
    run.stage("illustration", len(indices))
    note = (
        json.dumps(
            {k: v for k, v in (("prompt", prompt), ("template", template), ("checkpoint", checkpoint)) if v}
        )
        if (prompt or template or checkpoint)
        else None
    )
    run.expected = sum(1 for i in indices if run.reusable(image_step(i), ("research",), mode) is None)
    comfyui = ComfyUIClient(run.comfyui_url, run.settings.comfyui_timeout) if run.comfyui_url else None
    run.lease = lease_for(run.settings, run.comfyui_url, run.llm_urls[0])
    done = {}
    try:
        for i in indices:
            name = image_step(i)
            done[i] = await run.step(
                name,
                lambda i=i: _image(run, llm, comfyui, outline, i, prompt, template, checkpoint),
                ("research",),
                _image_mode(run, name, note, mode),
                note=note,
            )
            run.reporter.advance("illustration")
    finally:
        if comfyui is not None:
            await comfyui.aclose()
        if run.lease is not None:  # gives the card back to the LLM once ComfyUI is idle
            await run.lease.finish()
    return done


def _image_mode(run: RunSteps, name: str, note: str | None, mode: Mode) -> Mode:
    """An agent asking for the missing images also means those skipped before (ComfyUI was down, say)."""
    stored = run.store.step(run.run_id, name)
    if mode == "missing" and stored is not None and isinstance(stored.output, dict) and stored.output.get("skipped"):
        return "redo"
    return _mode(run, name, note, mode)


async def _image(
    run: RunSteps,
    llm: LLMRouter,
    comfyui: ComfyUIClient | None,
    outline: dict,
    i: int,
    prompt: str | None,
    template: str | None,
    checkpoint: str | None,
) -> dict:
    if comfyui is None:
        return {"skipped": NO_COMFYUI}
    prompt = prompt or await image_prompt(llm, outline, i, run.params)
    run.save(f"images/{i:02d}.prompt.txt", prompt)

    def progress(event: dict) -> None:
        if event.get("max"):
            run.reporter.detail(f"image {i + 1}: step {event['value']}/{event['max']}")

    try:
        async with holding(run.lease, template or run.params.template, f"{run.job_id}/{image_step(i)}"):
            png = await render(
                comfyui,
                prompt,
                run.params,
                i,
                progress,
                run.cancel_requested,
                {"scriptorium_job": run.job_id},
                template,
                checkpoint,
            )
    except Interrupted:
        raise
    except (ComfyUIError, TemplateError, LeaseError) as e:  # the article still completes, saying why
        return {"skipped": str(e), "prompt": prompt}
    return {"file": run.save(f"images/{i:02d}.png", png), "prompt": prompt}


def images_of(run: RunSteps, count: int) -> tuple[dict[int, dict], list[str], tuple[str, ...]]:
    """The images the article shows, why others are missing, and the steps they come from."""
    images, notes, names = {}, [], []
    for i in range(count):
        step = run.store.step(run.run_id, image_step(i))
        if step is None or step.status != "done" or not isinstance(step.output, dict):
            continue
        names.append(step.name)
        if step.output.get("file"):
            images[i] = step.output
        elif step.output.get("skipped") and step.output["skipped"] not in notes:
            notes.append(step.output["skipped"])
    return images, notes, tuple(names)


async def assemble(
    run: RunSteps, formats: tuple[str, ...] = ("md", "html"), post_process: bool = True
) -> dict:
    """article.md and/or article.html from the parts as they stand now (edited ones included), then ffmpeg."""
    outline = outline_of(run)
    count = len(outline["sections"])
    texts, written = [], tuple(section_step(i) for i in range(count))
    for i, name in enumerate(written):
        step = run.store.step(run.run_id, name)
        if step is None or step.status != "done" or not (run.dir / str(step.output)).is_file():
            raise StageError(f"section {i} is not written yet: call write_sections (or set_section) first")
        texts.append((run.dir / step.output).read_text(encoding="utf-8"))
    images, notes, illustrated = images_of(run, count)
    note = f"Images skipped: {'; '.join(notes)}" if notes else None
    run.stage("assembly", 2 if post_process else 1)
    run.expected = 2 if post_process else 1
    wanted = {"md": "markdown", "html": "html"}
    keys = sorted(wanted[f] for f in formats)
    stored = run.store.step(run.run_id, "assemble")
    mode: Mode = "stale" if stored is None or sorted(stored.output or {}) == keys else "redo"

    async def work() -> dict:
        out = {}
        if "md" in formats:
            out["markdown"] = run.save("article.md", assembly.article_markdown(outline, texts, images))
        if "html" in formats:
            out["html"] = run.save(
                "article.html", assembly.article_html(outline, texts, images, run.dir, note)
            )
        return out

    assembled = await run.step("assemble", work, ("research", *written, *illustrated), mode)
    run.reporter.advance("assembly")
    post = {"skipped": "not asked for"}
    if post_process:
        post = await run.step(
            "postprocess",
            lambda: asyncio.to_thread(
                assembly.postprocess, run.dir, [images[i]["file"] for i in sorted(images)], run.save
            ),
            illustrated,
        )
        run.reporter.advance("assembly")
    return {
        "run_dir": str(run.dir),
        "title": outline["title"],
        "article_md": str(run.dir / assembled["markdown"]) if assembled.get("markdown") else None,
        "article_html": str(run.dir / assembled["html"]) if assembled.get("html") else None,
        "images": [str(run.dir / images[i]["file"]) for i in sorted(images)],
        "images_skipped": note,
        "postprocess": post,
        "thumbnail": str(run.dir / post["thumbnail"]) if post.get("thumbnail") else None,
        "excerpt": texts[0][:300] if texts else "",
    }
