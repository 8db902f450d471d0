"""A short article from the real SmolLM2-135M (the embedded default) reads as prose: no loops, a real title."""

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from common.settings import Settings
from orchestrator.jobs import JobStore
from orchestrator.pipeline.prose import distinct_n
from tests.backend.server_process import ServerProcess
from tests.orchestrator.conftest import run_cli


@pytest.fixture(scope="module")
def smollm2_server(smollm2_path):
    server = ServerProcess(f"smollm2={smollm2_path}", "--max-model-len", "4096")
    yield server
    server.stop()


def test_a_short_smollm2_article_does_not_loop_and_has_a_real_title(tmp_path, smollm2_server):
    settings = Settings(home=tmp_path / "home", llm_urls=(f"{smollm2_server.url}/v1",), comfyui_url=None)
    done = run_cli(settings, "run", "The history of porridge", "--sections", "2", "--words", "60",
                   "--images", "0", "--seed", "1", "--json")
    assert done.returncode == 0, done.stderr
    run = JobStore(settings.jobs_db).recent(1)[0]
    article = (settings.runs_dir / run.id / "article.md").read_text()
    title = article.splitlines()[0].removeprefix("# ")
    body = "\n".join(line for line in article.splitlines() if not line.startswith("#"))
    assert len(body.split()) >= 40
    assert distinct_n(body, 4) >= 0.95, body
    assert 2 <= len(title.split()) <= 10 and not re.match(r"(?i)here (is|are)", title)
    html = settings.runs_dir / run.id / "article.html"
    assert title in html.read_text()
    browser = shutil.which("chromium")
    if browser:  # how a newcomer sees it: rendered headless (Debian's chromium); ARTICLE_SCREENSHOT keeps it
        shot = Path(os.environ.get("ARTICLE_SCREENSHOT", tmp_path / "article.png"))
        subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", f"--screenshot={shot}",
                        "--window-size=1000,1400", html.as_uri()], capture_output=True, timeout=120, check=True)
        assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
