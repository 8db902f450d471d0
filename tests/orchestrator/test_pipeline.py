"""The article pipeline against the real backend server and a ComfyUI that speaks ComfyUI's protocol."""

import json
import os
import shutil
import signal
from pathlib import Path

import pytest
from PIL import Image

from common.settings import Settings
from orchestrator import api
from orchestrator.jobs import JobStore
from tests.orchestrator.conftest import run_cli
from tests.serving import wait_for

ARGS = ("--sections", "2", "--images", "2", "--words", "40", "--seed", "7")


def test_full_pipeline_writes_every_file(settings):
    result = run_cli(settings, "run", "the history of paper", *ARGS, "--json")
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout)
    run_dir = Path(summary["run_dir"])
    outline = json.loads((run_dir / "research.json").read_text())
    assert len(outline["sections"]) == 2 and outline["title"]

    md = (run_dir / "article.md").read_text()
    assert md.startswith(f"# {outline['title']}")
    for section in outline["sections"]:
        assert f"## {section['heading']}" in md
    assert md.count("](images/") == 2

    page = (run_dir / "article.html").read_text()
    assert page.startswith("<!DOCTYPE html>") and page.count('src="data:image/png;base64,') == 2
    assert "Images skipped" not in page

    for path in summary["images"]:
        with Image.open(path) as image:
            assert image.format == "PNG" and image.size == (512, 512)  # the sd15 template's size
    if shutil.which("ffmpeg"):  # .ci/run installs it; without it the step says so
        for i in range(2):
            with Image.open(run_dir / "images" / "web" / f"{i:02d}.jpg") as web:
                assert web.format == "JPEG" and web.size[0] <= 1024
        with Image.open(summary["thumbnail"]) as thumb:
            assert thumb.format == "JPEG" and thumb.size == (320, 320)
    else:
        assert summary["postprocess"] == {"skipped": "ffmpeg is not installed"}

    store = JobStore(settings.jobs_db)
    run = store.get(summary["run_id"])
    assert run.status == "done" and run.progress == 1.0
    assert {s.name: s.status for s in store.steps(run.id)} == {
        "research": "done", "write:00": "done", "write:01": "done", "illustrate:00": "done",
        "illustrate:01": "done", "assemble": "done", "postprocess": "done"}
    shown = json.loads(run_cli(settings, "show", run.id[:10], "--json").stdout)
    assert shown["id"] == run.id and len(shown["steps"]) == 7
    listed = json.loads(run_cli(settings, "list", "--json").stdout)
    assert [r["id"] for r in listed["runs"]] == [run.id]


def test_without_comfyui_the_run_completes_and_says_why(settings):
    no_images = Settings(home=settings.home, llm_urls=settings.llm_urls, comfyui_url=None)
    result = run_cli(no_images, "run", "inks and quills", *ARGS, "--json")
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout)
    assert summary["images"] == [] and "ComfyUI is not configured" in summary["images_skipped"]
    assert "ComfyUI is not configured" in Path(summary["article_html"]).read_text()
    assert summary["postprocess"] == {"skipped": "no images to process"}


def test_a_killed_run_resumes_without_redoing_finished_steps(settings, comfyui):
    comfyui.behave(hang=True)
    run = api.start_article({"topic": "bookbinding", "sections": 2, "images": 2, "words_per_section": 40,
                             "seed": 3}, settings)
    store = JobStore(settings.jobs_db)
    wait_for(lambda: (s := store.step(run.id, "illustrate:00")) is not None and s.status == "running")
    before = {s.name: s.started for s in store.steps(run.id) if s.status == "done"}
    assert set(before) == {"research", "write:00", "write:01"}
    os.kill(store.get(run.id).pid, signal.SIGKILL)
    wait_for(lambda: store.get(run.id).interrupted)
    assert run_cli(settings, "list").stdout.count("interrupted") == 1

    comfyui.behave()
    result = run_cli(settings, "resume", run.id, "--json")
    assert result.returncode == 0, result.stderr
    finished = store.get(run.id)
    assert finished.status == "done" and len(finished.result["images"]) == 2
    after = {s.name: s.started for s in store.steps(run.id)}
    assert all(after[name] == started for name, started in before.items())  # not redone


def test_cancel_interrupts_the_comfyui_prompt(settings, comfyui):
    comfyui.behave(hang=True)
    run = api.start_article({"topic": "vellum", "sections": 2, "images": 1, "words_per_section": 40}, settings)
    store = JobStore(settings.jobs_db)
    wait_for(lambda: (s := store.step(run.id, "illustrate:00")) is not None and s.status == "running")
    wait_for(lambda: comfyui.queue()["queue_running"])  # the render itself, not the image prompt before it
    result = run_cli(settings, "cancel", run.id, "--json")
    assert result.returncode == 0, result.stderr
    wait_for(lambda: store.get(run.id).status == "cancelled", timeout=30)
    assert any(call["path"] == "/interrupt" for call in comfyui.calls())
    assert store.step(run.id, "assemble") is None  # nothing ran after the cancel
    assert run_cli(settings, "resume", run.id).returncode == 1  # a cancelled run stays cancelled


def test_malformed_json_is_retried_then_fails_clearly(settings, llm_server):
    import httpx

    def chat_requests() -> float:
        text = httpx.get(f"{llm_server.url}/metrics").text
        return sum(float(line.split()[-1]) for line in text.splitlines()
                   if line.startswith("scriptorium_requests_total"))

    before = chat_requests()
    # As with an upstream that ignores response_format: the random model's free text is not JSON.
    result = run_cli(settings, "run", "parchment", *ARGS, extra_env={"SCRIPTORIUM_LLM_STRUCTURED_OUTPUT": "0"})
    assert result.returncode == 1
    assert "no usable outline in 3 attempts" in result.stderr and "last answer began" in result.stderr
    assert chat_requests() - before == 3
    run = JobStore(settings.jobs_db).recent(1)[0]
    assert run.status == "failed" and "3 attempts" in run.error


def test_a_comfyui_node_error_is_reported_with_its_node(settings, comfyui):
    comfyui.behave(fail_class="KSampler", message="CUDA out of memory. Tried to allocate 2.00 GiB")
    result = run_cli(settings, "run", "illuminated letters", "--sections", "1", "--images", "1", "--words", "40",
                     "--json")
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout)
    assert summary["images"] == []
    assert "ComfyUI node 3 (KSampler): CUDA out of memory" in summary["images_skipped"]


@pytest.mark.parametrize("bad", [{"topic": ""}, {"topic": "x", "images": 5, "sections": 2},
                                 {"topic": "x", "sources": ["/no/such/file.md"]}, {"topic": "x", "colour": "red"}])
def test_bad_run_settings_are_refused_before_anything_starts(settings, bad):
    from orchestrator.pipeline.params import ParamsError

    with pytest.raises(ParamsError):
        api.start_article(bad, settings)
    assert JobStore(settings.jobs_db).recent() == []


def test_sources_ground_the_research_prompt(settings, tmp_path):
    source = tmp_path / "notes.md"
    source.write_text("Paper reached Samarkand in 751 and Baghdad soon after.")
    result = run_cli(settings, "run", "paper on the silk road", "--source", str(source), "--sections", "1",
                     "--images", "0", "--words", "40", "--json")
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout)
    outline = json.loads((Path(summary["run_dir"]) / "research.json").read_text())
    assert outline["sources"] == ["notes.md"]
