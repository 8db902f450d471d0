"""The loop guard against an upstream that loops: a stub speaking the OpenAI chat protocol (a real uvicorn server
on 127.0.0.1) answers with repeating text until it sees the stronger penalties, then with plain prose."""

import json
import threading

import pytest
import uvicorn
from fastapi import FastAPI

from common.settings import Settings
from orchestrator import history
from orchestrator.jobs import JobStore
from orchestrator.pipeline.prose import repeated_share
from orchestrator.pipeline.sampling import DEFAULTS
from tests.backend.server_process import free_port
from tests.orchestrator.conftest import run_cli
from tests.serving import wait_healthy

LOOP = "You will read about the first mug of porridge! The secrets of the scriptorium! " * 8
PROSE = ("Porridge began as a plain meal of grain and water, cooked slowly over a fire. Farmers ate it before "
         "dawn because it was cheap, warm and filling, and every region added what grew nearby.")
OUTLINE = {"title": "Here is a summary of porridge, which is a", "sections": [
    {"heading": "Origins", "key_points": ["grain", "fire"]}, {"heading": "Today", "key_points": ["oats", "milk"]}]}


def stub_app(requests: list[dict], max_model_len: int = 8192) -> FastAPI:
    app = FastAPI()

    @app.get("/health")
    def health() -> dict:
        return {}

    @app.get("/v1/models")
    def models() -> dict:
        return {"object": "list", "data": [{"id": "stub", "object": "model", "owned_by": "test",
                                            "max_model_len": max_model_len}]}

    @app.post("/v1/chat/completions")
    def chat(body: dict) -> dict:
        requests.append(body)
        if body.get("response_format"):
            text = json.dumps(OUTLINE)
        else:  # loops unless asked with the loop guard's stronger penalties
            text = PROSE if body.get("repetition_penalty", 1) > DEFAULTS["sections"].repetition_penalty else LOOP
        return {"id": "c1", "object": "chat.completion", "created": 0, "model": body["model"],
                "choices": [{"index": 0, "finish_reason": "stop",
                             "message": {"role": "assistant", "content": text}}],
                "usage": {"prompt_tokens": 10, "completion_tokens": 20, "total_tokens": 30}}

    return app


@pytest.fixture(params=[8192])
def looping_upstream(request):
    """(base URL, the chat requests it got); its model's context is the param (8192 unless a test says)."""
    requests: list[dict] = []
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(stub_app(requests, request.param), host="127.0.0.1", port=port,
                                          log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_healthy(f"http://127.0.0.1:{port}", 120)
    yield f"http://127.0.0.1:{port}/v1", requests
    server.should_exit = True
    thread.join(10)


def test_a_looping_section_is_rewritten_once_with_stronger_penalties_and_history_says_so(tmp_path, looping_upstream):
    url, requests = looping_upstream
    settings = Settings(home=tmp_path / "home", llm_urls=(url,), comfyui_url=None)
    assert repeated_share(LOOP) > 0.5
    done = run_cli(settings, "run", "porridge", "--sections", "2", "--images", "0", "--seed", "3", "--json")
    assert done.returncode == 0, done.stderr
    store = JobStore(settings.jobs_db)
    run = store.recent(1)[0]
    notes = {e.part: e.note for e in history.entries(store, run.id) if e.part.startswith("loop_guard:")}
    assert set(notes) == {"loop_guard:00", "loop_guard:01"}
    assert all("rewritten once" in n and "kept the rewrite" in n for n in notes.values())
    sections = [b for b in requests if not b.get("response_format")]
    assert len(sections) == 4  # each section: the looping answer, then exactly one rewrite
    assert sorted(b["repetition_penalty"] for b in sections) == [1.15, 1.15, 1.35, 1.35]
    article = (settings.runs_dir / run.id / "article.md").read_text()
    assert "secrets of the scriptorium" not in article and PROSE in article
    assert article.startswith("# Here is a summary") is False and "Porridge" in article.splitlines()[0]
    params = json.loads((settings.runs_dir / run.id / "params.json").read_text())
    assert params["sampling"]["sections"]["repetition_penalty"] == 1.15


@pytest.mark.parametrize("looping_upstream", [1024], indirect=True)
def test_a_runs_sampling_and_section_length_reach_the_model(tmp_path, looping_upstream):
    """`run --sampling` overrides reach every section request (and only the stage named), and a model whose
    context is small is asked for shorter sections (section_words: half the context for the article's text)."""
    url, requests = looping_upstream
    settings = Settings(home=tmp_path / "home", llm_urls=(url,), comfyui_url=None)
    overrides = {"sections": {"temperature": 0.3, "repetition_penalty": 1.2}}
    done = run_cli(settings, "run", "porridge", "--sections", "2", "--images", "0", "--seed", "3", "--words", "400",
                   "--sampling", json.dumps(overrides), "--json")
    assert done.returncode == 0, done.stderr
    outline = [b for b in requests if b.get("response_format")]
    sections = [b for b in requests if not b.get("response_format")]
    assert len(sections) == 2 and len(outline) == 1
    assert all(b["temperature"] == 0.3 and b["repetition_penalty"] == 1.2 for b in sections)
    assert outline[0]["temperature"] == DEFAULTS["outline"].temperature
    words = int(1024 // 2 // 2 / 1.6)  # 160 of the 400 asked: the context holds no more beside the prompts
    assert all(f"About {words} words" in b["messages"][-1]["content"] for b in sections)
    assert all(b["max_tokens"] <= 1024 for b in sections)
