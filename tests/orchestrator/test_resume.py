"""Resume trusts the files, not only the database: a missing, empty or changed step output is redone, and so is
every step that consumed it. Against the real backend server and the ComfyUI stand-in."""

import json
import os
import signal
import sqlite3
from pathlib import Path

from orchestrator import api
from orchestrator.jobs import JobStore
from tests.orchestrator.conftest import run_cli
from tests.serving import wait_for

ARGS = ("--sections", "2", "--images", "1", "--words", "40")


def started(store: JobStore, run_id: str) -> dict[str, float]:
    return {s.name: s.started for s in store.steps(run_id)}


def finished_run(settings, *extra: str) -> tuple[JobStore, str, Path]:
    """A run that finished but for its last step, as when ffmpeg fails on the images: resumable, assembled."""
    result = run_cli(settings, "run", "the care of old books", *ARGS, *extra, "--json")
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout)
    store = JobStore(settings.jobs_db)
    store.fail_step(summary["run_id"], "postprocess", "ffmpeg could not convert 00.png")
    store.update(summary["run_id"], status="failed", error="ffmpeg could not convert 00.png")
    return store, summary["run_id"], Path(summary["run_dir"])


def resume(settings, run_id: str) -> dict:
    result = run_cli(settings, "resume", run_id, "--json")
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr
    return json.loads(result.stdout)


def assert_article_has_each_section_once(run_dir: Path, sections: int) -> None:
    md = (run_dir / "article.md").read_text()
    assert md.count("\n## ") == sections
    for i in range(sections):
        text = (run_dir / "sections" / f"{i:02d}.md").read_text()
        assert text and md.count(text.strip()) == 1


def test_a_deleted_and_an_emptied_section_are_written_again(settings, comfyui):
    comfyui.behave(hang=True)
    run = api.start_article({"topic": "rebinding", "sections": 2, "images": 1, "words_per_section": 40, "seed": 5},
                            settings)
    store = JobStore(settings.jobs_db)
    wait_for(lambda: (s := store.step(run.id, "illustrate:00")) is not None and s.status == "running")
    os.kill(store.get(run.id).pid, signal.SIGKILL)
    wait_for(lambda: store.get(run.id).interrupted)
    comfyui.behave()
    run_dir = settings.runs_dir / run.id
    (run_dir / "sections" / "00.md").unlink()
    (run_dir / "sections" / "01.md").write_bytes(b"")
    before = started(store, run.id)

    resume(settings, run.id)
    after = started(store, run.id)
    assert after["research"] == before["research"]  # intact: not redone
    assert after["write:00"] != before["write:00"] and after["write:01"] != before["write:01"]
    assert store.get(run.id).status == "done"
    assert_article_has_each_section_once(run_dir, 2)


def test_a_changed_section_is_rewritten_and_the_article_assembled_again(settings):
    store, run_id, run_dir = finished_run(settings)  # no seed: a rewritten section reads differently
    section = run_dir / "sections" / "01.md"
    original = section.read_text()
    section.write_text("Tampered with after the run.")
    before = started(store, run_id)

    resume(settings, run_id)
    after = started(store, run_id)
    assert {n for n in after if after[n] != before[n]} == {"write:01", "assemble", "postprocess"}
    rewritten = section.read_text()
    assert rewritten != original and "Tampered" not in rewritten
    md = (run_dir / "article.md").read_text()
    assert "Tampered" not in md and original.strip() not in md
    assert_article_has_each_section_once(run_dir, 2)
    assert "Tampered" not in (run_dir / "article.html").read_text()


def test_an_image_that_fails_its_hash_is_rendered_again(settings, comfyui):
    store, run_id, run_dir = finished_run(settings)  # no seed: the image rendered again differs
    image = run_dir / "images" / "00.png"
    image.write_bytes(image.read_bytes()[:100])  # torn, as by a copy that stopped half way
    renders = sum(1 for c in comfyui.calls() if c["path"] == "/prompt")
    before = started(store, run_id)

    summary = resume(settings, run_id)
    after = started(store, run_id)
    assert after["illustrate:00"] != before["illustrate:00"] and after["assemble"] != before["assemble"]
    assert after["write:00"] == before["write:00"] and after["write:01"] == before["write:01"]
    assert sum(1 for c in comfyui.calls() if c["path"] == "/prompt") == renders + 1
    assert image.read_bytes().startswith(b"\x89PNG") and len(image.read_bytes()) > 100
    assert summary["images"] == [str(image)]


def test_a_database_from_before_hashes_is_migrated_and_checked_for_presence(settings):
    store, run_id, run_dir = finished_run(settings, "--seed", "13")
    before = started(store, run_id)
    with sqlite3.connect(settings.jobs_db) as db:  # the steps table as the previous version made it
        db.execute("ALTER TABLE steps DROP COLUMN files")
        db.execute("ALTER TABLE steps DROP COLUMN inputs")
        db.execute("PRAGMA user_version = 0")
    (run_dir / "sections" / "00.md").write_text("Edited by hand, and kept: an old row has no hash to check.")
    (run_dir / "sections" / "01.md").write_bytes(b"")

    resume(settings, run_id)
    after = JobStore(settings.jobs_db)
    steps = {s.name: s for s in after.steps(run_id)}
    assert steps["write:00"].started == before["write:00"] and steps["write:00"].files is None
    assert steps["write:01"].started != before["write:01"] and "sections/01.md" in steps["write:01"].files
    assert steps["assemble"].started != before["assemble"]  # its input was redone after it
    md = (run_dir / "article.md").read_text()
    assert md.count("Edited by hand") == 1
    assert_article_has_each_section_once(run_dir, 2)
