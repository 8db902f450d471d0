"""A shared run as agents see it (get_run): the outline, each section and image with its status and version,
the assembled outputs, and the history of who changed what. A part is stale when what it was made from has
changed since (a section written from outline version 2 after the outline became version 3)."""

from pathlib import Path

from common.settings import Settings
from orchestrator import history
from orchestrator.jobs import JobError, JobStore, Step
from orchestrator.pipeline import step_reuse
from orchestrator.pipeline.params import ArticleParams

DONE = ("done", "skipped")


def view(store: JobStore, settings: Settings, run_id: str) -> dict:
    run = store.get(run_id)
    if run.kind != "article":
        raise JobError(f"{run.id} is a {run.kind} job, not an article run")
    params = ArticleParams.from_dict(run.params)
    run_dir = settings.runs_dir / run.id
    steps = {s.name: s for s in store.steps(run.id)}
    log = history.entries(store, run.id)
    last = {e.part: e for e in log}
    outline_versions = {e.digest: e.version for e in log if e.part == "research"}

    def part(name: str, inputs: tuple[str, ...]) -> dict:
        step = steps.get(name)
        entry = last.get(name)
        state = {
            "status": "missing",
            "version": entry.version if entry else 0,
            "stale_reason": None,
            "outline_version": None,
            "error": None,
            "changed_by": {"client": entry.client, "tool": entry.tool, "at": entry.at} if entry else None,
        }
        if step is None:
            return state
        state["status"] = step.status
        state["error"] = step.error
        if step.status in DONE:
            if entry is None:
                state["version"] = 1  # finished before versions were recorded
            why = step_reuse.stale_reason(run_dir, step, {n: steps.get(n) for n in inputs})
            if why:
                state["status"], state["stale_reason"] = "stale", why
        if step.inputs and "research" in step.inputs:
            state["outline_version"] = outline_versions.get(step.inputs["research"])
        return state

    research = steps.get("research")
    outline = research.output if research is not None and research.status in DONE else None
    count = len(outline["sections"]) if outline else params.sections
    sections = [
        _section(
            run_dir,
            i,
            outline,
            steps.get(f"write:{i:02d}"),
            part(f"write:{i:02d}", ("research",)),
            last.get(f"review:{i:02d}"),
        )
        for i in range(count)
    ]
    indices = sorted(
        set(range(min(params.images, count)))
        | {
            int(n.split(":")[1])
            for n in steps
            if n.startswith("illustrate:") and int(n.split(":")[1]) < count
        }
    )
    images = [
        _image(run_dir, i, steps.get(f"illustrate:{i:02d}"), part(f"illustrate:{i:02d}", ("research",)))
        for i in indices
    ]
    consumed = (
        "research",
        *(f"write:{i:02d}" for i in range(count)),
        *(f"illustrate:{i:02d}" for i in indices if f"illustrate:{i:02d}" in steps),
    )
    assembled = part("assemble", consumed)
    done = steps.get("assemble")
    files = done.output if done is not None and isinstance(done.output, dict) else {}
    post = steps.get("postprocess")
    return {
        "run_id": run.id,
        "status": run.status,
        "topic": params.topic,
        "audience": params.audience,
        "params": params.to_dict(),
        "outline": {
            **part("research", ()),
            "title": outline["title"] if outline else None,
            "sections": [
                {"heading": s["heading"], "key_points": s["key_points"]} for s in outline["sections"]
            ]
            if outline
            else [],
            "sources": outline.get("sources", []) if outline else [],
        },
        "sections": sections,
        "images": images,
        "outputs": {
            **assembled,
            "markdown": _path(run_dir, files.get("markdown")),
            "html": _path(run_dir, files.get("html")),
            "postprocess": post.output if post is not None and post.status in DONE else None,
        },
        "history": [{**e.to_dict(), "what": history.describe(e.part)} for e in log],
    }


def _path(run_dir: Path, relative: str | None) -> str | None:
    return str(run_dir / relative) if relative else None


def _section(
    run_dir: Path, i: int, outline: dict | None, step: Step | None, state: dict, review: history.Entry | None
) -> dict:
    rejected = None
    if review is not None and step is not None and step.status == "done" and review.digest == step.digest:
        state["status"] = "rejected"  # the text rejected is still the one there
        rejected = {"reason": review.note, "client": review.client, "at": review.at}
    text = None
    if step is not None and isinstance(step.output, str) and (run_dir / step.output).is_file():
        text = (run_dir / step.output).read_text(encoding="utf-8", errors="replace")
    heading = outline["sections"][i]["heading"] if outline else None
    return {
        "index": i,
        "heading": heading,
        **state,
        "text": text,
        "words": len(text.split()) if text else 0,
        "rejected": rejected,
    }


def _image(run_dir: Path, i: int, step: Step | None, state: dict) -> dict:
    out = step.output if step is not None and isinstance(step.output, dict) else {}
    if state["status"] == "done" and out.get("skipped"):
        state["status"] = "skipped"
    return {
        "index": i,
        **state,
        "prompt": out.get("prompt"),
        "file": _path(run_dir, out.get("file")),
        "skipped": out.get("skipped"),
    }
