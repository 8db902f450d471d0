"""Agents' own parts of a shared run: an outline (checked against its JSON schema), a section's text, an image
made elsewhere. Each is a new version of its part, refused when the caller's expected_version is stale; the
versions before stay in the history (texts in the database, images under the run's history/)."""

import io
import json
import time
from pathlib import Path

import jsonschema

from common.files import atomic_write_bytes
from common.hashing import fingerprint
from common.settings import Settings
from orchestrator import history
from orchestrator.history import Actor
from orchestrator.jobs import JobError, JobStore, Run, Step
from orchestrator.pipeline.params import ArticleParams
from orchestrator.pipeline.research import outline_schema
from orchestrator.pipeline.step_reuse import keep_previous

MAX_SECTIONS = 12


class EditError(ValueError):
    """An edit that cannot be taken as it is (it says why)."""


def edit_schema() -> dict:
    """The outline an agent may set: the research stage's schema, with 1 to 12 sections."""
    schema = outline_schema(1)
    schema["properties"]["sections"].update(minItems=1, maxItems=MAX_SECTIONS)
    return schema


def article_run(store: JobStore, run_id: str) -> Run:
    run = store.get(run_id)
    if run.kind != "article":
        raise JobError(f"{run.id} is a {run.kind} job, not an article run")
    return run


def set_outline(
    store: JobStore, settings: Settings, run_id: str, outline: dict, expected_version: int, actor: Actor
) -> int:
    """Replace the outline; the run's number of sections follows it. Returns the outline's new version."""
    run = article_run(store, run_id)
    problems = sorted(
        jsonschema.Draft202012Validator(edit_schema()).iter_errors(outline), key=lambda e: list(e.path)
    )
    if problems:
        said = "; ".join(
            f"{'/'.join(str(p) for p in e.path) or 'outline'}: {e.message}" for e in problems[:5]
        )
        raise EditError(f"the outline does not match its schema: {said}")
    params = ArticleParams.from_dict(run.params)
    research = store.step(run.id, "research")
    if research is not None and isinstance(research.output, dict):
        sources = research.output.get("sources", [])
    else:
        sources = [Path(s).name for s in params.sources]
    stored = {
        "title": outline["title"].strip(),
        "sections": [
            {"heading": s["heading"].strip(), "key_points": [p.strip() for p in s["key_points"]]}
            for s in outline["sections"]
        ],
        "sources": sources,
    }
    data = json.dumps(stored, indent=2).encode()
    count = len(stored["sections"])

    def write(db, _version: int) -> None:
        atomic_write_bytes(settings.runs_dir / run.id / "research.json", data)
        if count != params.sections:
            changed = {**params.to_dict(), "sections": count, "images": min(params.images, count)}
            db.execute(
                "UPDATE runs SET params = ?, updated = ? WHERE id = ?",
                (json.dumps(changed), time.time(), run.id),
            )

    return history.commit(
        store,
        run.id,
        "research",
        stored,
        {"research.json": fingerprint(data)},
        {},
        actor,
        content=json.dumps(stored),
        expected_version=expected_version,
        write=write,
        started=time.time(),
    )


def _outline_step(store: JobStore, run: Run, index: int, what: str) -> Step:
    research = store.step(run.id, "research")
    if research is None or research.status != "done" or not isinstance(research.output, dict):
        raise EditError(
            f"run {run.id} has no outline yet: call research or set_outline before setting a {what}"
        )
    count = len(research.output["sections"])
    if not 0 <= index < count:
        raise EditError(f"{what} {index} does not exist: the outline has sections 0 to {count - 1}")
    return research


def set_section(
    store: JobStore,
    settings: Settings,
    run_id: str,
    index: int,
    text: str,
    expected_version: int,
    actor: Actor,
) -> int:
    """A section's text as the agent wrote it, made against the current outline; returns its new version."""
    run = article_run(store, run_id)
    research = _outline_step(store, run, index, "section")
    if not isinstance(text, str) or not text.strip():
        raise EditError("the section's text is empty")
    text = text.strip() + "\n"
    relative = f"sections/{index:02d}.md"
    data = text.encode()
    return history.commit(
        store,
        run.id,
        f"write:{index:02d}",
        relative,
        {relative: fingerprint(data)},
        {"research": research.digest},
        actor,
        content=text,
        expected_version=expected_version,
        write=lambda _db, _v: atomic_write_bytes(settings.runs_dir / run.id / relative, data),
        started=time.time(),
    )


def reject_section(
    store: JobStore, run_id: str, index: int, reason: str, expected_version: int | None, actor: Actor
) -> int:
    """Send a section back: get_run shows it as rejected, with the reason, until a new version of it is made.
    expected_version: the version rejected (refused if the section changed since). Returns the section's version."""
    run = article_run(store, run_id)
    _outline_step(store, run, index, "section")
    if not isinstance(reason, str) or not reason.strip():
        raise EditError("say why the section is rejected: the writer rewrites it from the reason")
    name = f"write:{index:02d}"
    step = store.step(run.id, name)
    last = history.latest(store, run.id, name)
    current = last.version if last else 0
    if step is None or step.status != "done":
        raise EditError(f"section {index} is not written yet: there is nothing to reject")
    if expected_version is not None and expected_version != current:
        raise history.VersionConflict(
            f"section {index} is at version {current}, not {expected_version}: read it "
            "again with get_run before you review it",
            current,
        )
    history.remark(store, run.id, f"review:{index:02d}", step.digest, actor, reason.strip())
    return current


def set_image(
    store: JobStore,
    settings: Settings,
    run_id: str,
    index: int,
    source: Path,
    prompt: str | None,
    expected_version: int | None,
    actor: Actor,
) -> int:
    """An image file (PNG, JPEG, WebP, ...) as section index's illustration, stored as PNG; the one it replaces
    is kept under history/. Returns the image's new version."""
    run = article_run(store, run_id)
    research = _outline_step(store, run, index, "image")
    data = as_png(Path(source))
    name = f"illustrate:{index:02d}"
    run_dir = settings.runs_dir / run.id
    relative = f"images/{index:02d}.png"
    output = {
        "file": relative,
        "prompt": prompt or f"an image supplied by {actor.client} ({Path(source).name})",
    }

    def write(_db, version: int) -> None:
        keep_previous(run_dir, name, store.step(run.id, name), version)
        atomic_write_bytes(run_dir / relative, data)

    return history.commit(
        store,
        run.id,
        name,
        output,
        {relative: fingerprint(data)},
        {"research": research.digest},
        actor,
        note=str(source),
        expected_version=expected_version,
        write=write,
        started=time.time(),
    )


def as_png(path: Path) -> bytes:
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as image:
            if image.format == "PNG":
                return path.read_bytes()
            out = io.BytesIO()
            image.convert("RGBA" if "A" in image.getbands() else "RGB").save(out, "PNG")
            return out.getvalue()
    except FileNotFoundError:
        raise EditError(f"image {path} does not exist") from None
    except (UnidentifiedImageError, OSError) as e:
        raise EditError(f"{path} is not an image this stack can read ({e})") from None
