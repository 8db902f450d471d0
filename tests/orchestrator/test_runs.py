"""Shared runs: the stages one at a time, agents' edits with versions, stale marking and history, against the real
backend server and the ComfyUI stand-in (stage jobs done in this process; the MCP tests use workers)."""

import asyncio
import io
import json
import threading
from pathlib import Path

import pytest
from PIL import Image

from orchestrator import api, history
from orchestrator.jobs import JobStore
from orchestrator.pipeline.stage_job import run_stage
from orchestrator.pipeline.stages import StageError

EDITED = {
    "title": "Paper Through the Ages",
    "sections": [
        {"heading": "Rags and Mulberry Bark", "key_points": ["Cai Lun's recipe", "fibres beaten to pulp"]},
        {"heading": "Mills Along the Rivers", "key_points": ["water power", "the spread to Europe"]},
    ],
}


def stage(settings, run_id: str, name: str, client: str = "agent", **args) -> dict:
    job = api.create_stage_job(run_id, name, args, api.Actor(client, name), settings)
    return asyncio.run(run_stage(JobStore(settings.jobs_db), job.id, settings))


def new_run(settings, **extra) -> str:
    params = {
        "topic": "the history of paper",
        "sections": 2,
        "images": 1,
        "words_per_section": 40,
        "seed": 11,
    }
    return api.create_run({**params, **extra}, settings).id


def png(colour: str, size=(64, 48), format="PNG") -> bytes:
    out = io.BytesIO()
    Image.new("RGB", size, colour).save(out, format)
    return out.getvalue()


def test_stages_one_at_a_time_with_an_edited_outline(settings):
    run_id = new_run(settings)
    assert api.get(run_id, settings).status == "open"
    with pytest.raises(StageError, match="no outline yet"):
        stage(settings, run_id, "write_sections")

    done = stage(settings, run_id, "research", client="researcher")
    assert done["changed"] == [{"part": "research", "what": "the outline", "version": 1}]
    state = api.get_run(run_id, settings)
    assert state["outline"]["version"] == 1 and len(state["outline"]["sections"]) == 2
    assert state["outline"]["changed_by"]["client"] == "researcher"
    assert [s["status"] for s in state["sections"]] == ["missing", "missing"]

    assert api.set_outline(run_id, EDITED, 1, api.Actor("editor", "set_outline"), settings) == 2
    with pytest.raises(
        api.VersionConflict, match="at version 2 \\(by editor with set_outline\\), not 1"
    ) as refused:
        api.set_outline(
            run_id, {**EDITED, "title": "Overwritten"}, 1, api.Actor("late", "set_outline"), settings
        )
    assert refused.value.current == 2
    state = api.get_run(run_id, settings)
    assert state["outline"]["title"] == EDITED["title"] and state["outline"]["version"] == 2

    stage(settings, run_id, "write_sections", client="writer")
    state = api.get_run(run_id, settings)
    assert [(s["status"], s["version"], s["outline_version"]) for s in state["sections"]] == [
        ("done", 1, 2)
    ] * 2
    assert all(s["text"] and s["changed_by"]["client"] == "writer" for s in state["sections"])
    assert [s["heading"] for s in state["sections"]] == [s["heading"] for s in EDITED["sections"]]

    third = {**EDITED, "title": "Paper, Briefly"}
    assert api.set_outline(run_id, third, 2, api.Actor("editor", "set_outline"), settings) == 3
    state = api.get_run(run_id, settings)
    assert [s["status"] for s in state["sections"]] == ["stale", "stale"]  # written from version 2
    assert state["sections"][0]["outline_version"] == 2 and "research" in state["sections"][0]["stale_reason"]

    store = JobStore(settings.jobs_db)
    before = {s.name: s.started for s in store.steps(run_id)}
    stage(settings, run_id, "write_sections", client="writer")  # only what is missing: stale ones are kept
    assert {s.name: s.started for s in store.steps(run_id)} == before
    again = stage(settings, run_id, "write_section", client="writer", index=0)
    assert [c["part"] for c in again["changed"]] == ["write:00"]
    state = api.get_run(run_id, settings)
    assert [(s["status"], s["version"], s["outline_version"]) for s in state["sections"]] == [
        ("done", 2, 3),
        ("stale", 1, 2),
    ]

    stage(settings, run_id, "illustrate", client="illustrator")
    result = stage(settings, run_id, "assemble", client="integrator", formats=["md", "html"])["article"]
    md = Path(result["article_md"]).read_text()
    assert (
        md.startswith("# Paper, Briefly") and "## Mills Along the Rivers" in md and md.count("](images/") == 1
    )
    for section in api.get_run(run_id, settings)["sections"]:
        assert section["text"].strip() in md
    state = api.get_run(run_id, settings)
    assert state["outputs"]["status"] == "done" and state["images"][0]["status"] == "done"
    parts = [(e["part"], e["version"], e["client"]) for e in state["history"]]
    assert parts[:2] == [("research", 1, "researcher"), ("research", 2, "editor")]
    assert ("illustrate:00", 1, "illustrator") in parts and ("assemble", 1, "integrator") in parts
    # every outline version is kept, the refused one is not among them
    kept = [json.loads(history.content(store, run_id, "research", v))["title"] for v in (1, 2, 3)]
    assert kept[1:] == [EDITED["title"], "Paper, Briefly"] and "Overwritten" not in kept


def test_an_edited_section_is_what_assembly_uses(settings):
    run_id = new_run(settings, images=0)
    stage(settings, run_id, "research")
    assert (
        api.set_section(
            run_id, 0, "Written by hand, about rag paper.", 0, api.Actor("human", "set_section"), settings
        )
        == 1
    )
    done = stage(settings, run_id, "write_sections", client="writer")
    assert [c["part"] for c in done["changed"]] == ["write:01"]  # section 0 stood
    first = stage(settings, run_id, "assemble")["article"]
    assert "Written by hand, about rag paper." in Path(first["article_md"]).read_text()

    store = JobStore(settings.jobs_db)
    written = store.step(run_id, "write:01").started
    with pytest.raises(api.VersionConflict, match="section 1 is at version 1"):
        api.set_section(run_id, 1, "stale edit", 0, api.Actor("human", "set_section"), settings)
    api.set_section(run_id, 1, "A better second section.", 1, api.Actor("human", "set_section"), settings)
    state = api.get_run(run_id, settings)
    assert state["outputs"]["status"] == "stale" and "write:01" in state["outputs"]["stale_reason"]
    second = stage(settings, run_id, "assemble")["article"]
    md = Path(second["article_md"]).read_text()
    assert "A better second section." in md and "stale edit" not in md
    assert store.step(run_id, "write:01").started != written  # the edit, not the model, made version 2
    assert api.get_run(run_id, settings)["outputs"]["status"] == "done"
    assert history.content(store, run_id, "write:01", 2) == "A better second section.\n"


def test_concurrent_edits_of_one_version_one_wins_and_nothing_is_lost(settings):
    run_id = new_run(settings, images=0)
    stage(settings, run_id, "research")
    outcomes: list = []

    def edit(who: str) -> None:
        try:
            api.set_section(run_id, 0, f"text by {who}", 0, api.Actor(who, "set_section"), settings)
            outcomes.append(("won", who))
        except api.VersionConflict as e:
            outcomes.append(("refused", e.current))

    threads = [threading.Thread(target=edit, args=(f"agent-{i}",)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    winners = [who for what, who in outcomes if what == "won"]
    assert len(winners) == 1 and sorted(o for o in outcomes if o[0] == "refused") == [("refused", 1)] * 3
    section = api.get_run(run_id, settings)["sections"][0]
    assert section["text"] == f"text by {winners[0]}\n" and section["version"] == 1


def test_an_outline_that_breaks_its_schema_is_refused(settings):
    run_id = new_run(settings)
    bad = {"title": "T", "sections": [{"heading": "One", "key_points": ["only one"]}], "extra": 1}
    with pytest.raises(api.EditError, match="does not match its schema") as refused:
        api.set_outline(run_id, bad, 0, api.Actor("a", "set_outline"), settings)
    assert "title" in str(refused.value) and "sections/0/key_points" in str(refused.value)
    assert api.get_run(run_id, settings)["outline"]["status"] == "missing"
    # an agent's own research: three sections where the run asked for two; the run follows the outline
    own = {
        "title": "Three Parts",
        "sections": [{"heading": f"Part {i}", "key_points": ["a point", "another"]} for i in range(3)],
    }
    assert api.set_outline(run_id, own, 0, api.Actor("a", "set_outline"), settings) == 1
    state = api.get_run(run_id, settings)
    assert len(state["sections"]) == 3 and state["params"]["sections"] == 3


def test_set_image_replaces_and_keeps_the_previous(settings, tmp_path):
    run_id = new_run(settings)
    stage(settings, run_id, "research")
    with pytest.raises(api.EditError, match="image 5 does not exist"):
        api.set_image(run_id, 5, tmp_path / "x.png", api.Actor("a", "set_image"), settings=settings)
    (tmp_path / "first.jpg").write_bytes(png("red", format="JPEG"))
    (tmp_path / "second.png").write_bytes(png("blue"))
    (tmp_path / "not.png").write_text("text")
    with pytest.raises(api.EditError, match="not an image"):
        api.set_image(run_id, 0, tmp_path / "not.png", api.Actor("a", "set_image"), settings=settings)
    assert (
        api.set_image(
            run_id, 0, tmp_path / "first.jpg", api.Actor("a", "set_image"), "a red square", settings=settings
        )
        == 1
    )
    assert (
        api.set_image(
            run_id,
            0,
            tmp_path / "second.png",
            api.Actor("b", "set_image"),
            expected_version=1,
            settings=settings,
        )
        == 2
    )
    run_dir = settings.runs_dir / run_id
    with Image.open(run_dir / "history" / "illustrate-00.v1" / "images" / "00.png") as kept:
        assert kept.format == "PNG" and kept.getpixel((1, 1))[0] > 200  # the red one, converted to PNG
    assert (run_dir / "images" / "00.png").read_bytes() == png("blue")
    image = api.get_run(run_id, settings)["images"][0]
    assert image["version"] == 2 and image["changed_by"]["client"] == "b" and "second.png" in image["prompt"]


def test_the_pipeline_records_its_parts_as_versions(settings):
    from tests.orchestrator.conftest import run_cli

    result = run_cli(
        settings, "run", "wax tablets", "--sections", "1", "--images", "1", "--words", "40", "--json"
    )
    assert result.returncode == 0, result.stderr
    state = api.get_run(json.loads(result.stdout)["run_id"], settings)
    assert state["outline"]["version"] == 1 and state["sections"][0]["status"] == "done"
    assert {(e["part"], e["client"]) for e in state["history"]} == {
        ("research", "pipeline"),
        ("write:00", "pipeline"),
        ("illustrate:00", "pipeline"),
        ("assemble", "pipeline"),
        ("postprocess", "pipeline"),
    }


def test_a_rejected_section_is_rewritten_from_the_reason(settings):
    run_id = new_run(settings, images=0)
    stage(settings, run_id, "research")
    stage(settings, run_id, "write_sections", client="writer")
    with pytest.raises(api.EditError, match="say why"):
        api.reject_section(run_id, 1, " ", api.Actor("integrator", "reject_section"), settings=settings)
    with pytest.raises(api.VersionConflict, match="section 1 is at version 1, not 3"):
        api.reject_section(run_id, 1, "too thin", api.Actor("integrator", "reject_section"), 3, settings)
    assert (
        api.reject_section(
            run_id, 1, "Too thin: add one example.", api.Actor("integrator", "reject_section"), 1, settings
        )
        == 1
    )
    section = api.get_run(run_id, settings)["sections"][1]
    assert section["status"] == "rejected" and section["rejected"]["reason"] == "Too thin: add one example."
    assert section["rejected"]["client"] == "integrator"
    old = section["text"]

    done = stage(settings, run_id, "write_sections", client="writer")  # the missing ones and the rejected one
    assert [c["part"] for c in done["changed"]] == ["write:01"]
    state = api.get_run(run_id, settings)
    section = state["sections"][1]
    assert (section["status"], section["version"], section["rejected"]) == ("done", 2, None)
    assert section["text"] != old
    notes = [
        (e["part"], e["tool"], e["note"]) for e in state["history"] if e["part"] in ("write:01", "review:01")
    ]
    assert notes[-2:] == [
        ("review:01", "reject_section", "Too thin: add one example."),
        ("write:01", "write_sections", "Too thin: add one example."),
    ]
