"""resources/list at a stdio start: Claude Code asks for the tools, prompts and resources lists together and
offers none of the server's tools until all three are answered, so the front answers resources/list from jobs.db
before the SDK has loaded, with what the SDK server answers once it has."""

import os

import pytest

from common.settings import Settings
from orchestrator.jobs import JobStore
from tests.mcp_server.test_stdio_first_start import GATE
from tests.mcp_server.test_stdio_front import INIT, Raw, session


@pytest.fixture
def settings(tmp_path) -> Settings:
    return Settings(home=tmp_path / "home", llm_urls=("http://127.0.0.1:9/v1",), mcp_toolsets=("core",))


def jobs(settings: Settings) -> list[str]:
    """A finished article job with its files and a held queued image job (this process has it, so listing it
    starts no worker)."""
    store = JobStore(settings.jobs_db)
    done = store.create_run("article", {"topic": "iron gall ink"}, status="done", pid=os.getpid())
    store.update(
        done.id,
        result={
            "article_md": "/x/article.md",
            "article_html": "/x/article.html",
            "images": ["/x/images/folio-1.png"],
        },
    )
    waiting = store.create_run("image", {"prompt": "a scribe at work"}, pid=os.getpid())
    return [done.id, waiting.id]


def test_resources_list_is_answered_before_the_sdk_loads_as_the_sdk_server_answers_it(
    settings, tmp_path, monkeypatch
):
    session(settings)  # an earlier start: the tools and prompts lists are remembered
    ids = jobs(settings)
    gate = tmp_path / "gate"
    gate.mkdir()
    (gate / "sitecustomize.py").write_text(GATE)
    release = tmp_path / "release"
    monkeypatch.setenv("PYTHONPATH", str(gate))
    monkeypatch.setenv("SDK_RELEASE", str(release))
    raw = Raw(settings)
    raw.ask("initialize", INIT)
    raw.send("notifications/initialized", notify=True)
    assert raw.ask("tools/list")["tools"] and raw.ask("prompts/list")["prompts"]
    before = raw.ask("resources/list")  # the SDK cannot load before the release file exists
    assert not release.exists()
    release.touch()
    assert raw.ask("resources/templates/list")["resourceTemplates"]  # only the SDK server answers it
    after = raw.ask("resources/list")  # handed over: the SDK server answers
    assert raw.close() == 0
    assert before == after
    listed = [r["uri"] for r in before["resources"]]
    job = "scriptorium://jobs/" + ids[0]
    assert listed == [
        f"scriptorium://jobs/{ids[1]}",
        job,
        f"{job}/article.md",
        f"{job}/article.html",
        f"{job}/images/folio-1.png",
    ]  # newest first, each job followed by its files
    assert "warning" not in raw.stderr
