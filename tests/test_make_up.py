"""The newcomer path: what `make up` does (ops up on the embedded default, then one article through the
MCP server's HTTP transport), in a temporary SCRIPTORIUM_HOME on free ports, reusing this environment."""

import json
import os
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

from tests.backend.server_process import ROOT, free_port


def test_make_up_flow_writes_an_article_and_is_idempotent(tmp_path, smollm2_path):
    home = tmp_path / "home"
    (home / "models" / "smollm2").mkdir(parents=True)
    shutil.copy(smollm2_path, home / "models" / "smollm2" / smollm2_path.name)  # saves the download
    env = {**os.environ, "SCRIPTORIUM_HOME": str(home), "SCRIPTORIUM_BACKEND_PORT": str(free_port()),
           "SCRIPTORIUM_MCP_PORT": str(free_port()), "SCRIPTORIUM_DEMO_SECTIONS": "2", "SCRIPTORIUM_DEMO_WORDS": "50"}
    for var in ("SCRIPTORIUM_LLM_URL", "SCRIPTORIUM_COMFYUI_URL", "SCRIPTORIUM_MODEL", "SCRIPTORIUM_COMPOSE"):
        env.pop(var, None)

    def run(*args, timeout=900):
        return subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True, env=env, cwd=ROOT,
                              timeout=timeout)

    try:
        up = run("ops", "up")
        assert up.returncode == 0, up.stderr
        article = run("mcp_server.try_pipeline")
        assert article.returncode == 0, article.stderr
        heading, where = article.stdout.strip().splitlines()
        html = Path(where)
        title, _, count = heading.rpartition(" (")
        assert title and count.endswith(" words)") and int(count.split()[0]) > 0
        assert f"<title>{title}</title>" in html.read_text() or title in html.read_text()
        assert html.name == "article.html" and html.is_relative_to(home / "runs")
        page = html.read_text()
        assert page.startswith("<!DOCTYPE html>") and page.count("<h2>") == 2
        assert "ComfyUI is not configured" in page  # the pipeline says why it has no images
        assert "note: Images skipped" in article.stderr

        with sqlite3.connect(home / "jobs.db") as db:
            status, result = db.execute("SELECT status, result FROM runs").fetchone()
        assert status == "done" and json.loads(result)["article_html"] == str(html)

        pids = {s["service"]: s["pid"] for s in json.loads(run("ops", "status", "--json").stdout)["services"]}
        again = run("ops", "up")
        assert again.returncode == 0 and again.stderr.count("already healthy") == 2
        after = {s["service"]: s["pid"] for s in json.loads(run("ops", "status", "--json").stdout)["services"]}
        assert after == pids
    finally:
        run("ops", "down")
