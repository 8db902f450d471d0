"""`python -m orchestrator create|research|write|illustrate|assemble|show RUN`: a shared run's stages by hand, as
real processes against the real backend and the ComfyUI stand-in."""

import json
from pathlib import Path

from tests.orchestrator.conftest import run_cli


def ok(settings, *args: str) -> str:
    result = run_cli(settings, *args)
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_each_stage_by_hand(settings):
    run_id = ok(
        settings,
        "create",
        "the history of paper",
        "--sections",
        "2",
        "--images",
        "1",
        "--words",
        "40",
        "--seed",
        "5",
    ).strip()
    early = run_cli(settings, "write", run_id)
    assert early.returncode == 1 and early.stderr.strip().splitlines() == [
        f"error: run {run_id} has no outline yet: call research (or set_outline) first"
    ]

    researched = json.loads(ok(settings, "research", run_id, "--json"))
    assert researched["run_id"] == run_id and [c["part"] for c in researched["changed"]] == ["research"]
    assert (
        ok(settings, "write", run_id).strip() == "write_sections changed section 0 (version 1), section 1 "
        "(version 1)"
    )
    again = json.loads(ok(settings, "write", run_id, "--json"))
    assert again["changed"] == [] and again["summary"].endswith("nothing: every part stands")
    one = json.loads(ok(settings, "write", run_id, "--section", "1", "--instructions", "Shorter.", "--json"))
    assert one["changed"] == [{"part": "write:01", "what": "section 1", "version": 2}]
    ok(settings, "illustrate", run_id)
    html = Path(ok(settings, "assemble", run_id).strip())
    assert html.name == "article.html" and html.read_text().count('src="data:image/png;base64,') == 1

    shown = json.loads(ok(settings, "show", run_id, "--json"))
    parts = shown["run"]
    assert [
        (s["version"], s["changed_by"]["client"], s["changed_by"]["tool"]) for s in parts["sections"]
    ] == [(1, "cli", "write"), (2, "cli", "write")]
    assert parts["outputs"]["status"] == "done" and parts["outputs"]["html"] == str(html)
    text = ok(settings, "show", run_id)
    assert "section 1  v2 done (cli)" in text and f"article   v1 done (cli)  {html}" in text
    listed = ok(settings, "list")
    assert f"assemble of {run_id}" in listed and "the history of paper" in listed

    missing = run_cli(settings, "research", "no-such-run")
    assert missing.returncode == 1 and "no run 'no-such-run'" in missing.stderr
