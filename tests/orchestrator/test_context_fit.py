"""The pipeline fits its token budgets to the server's context: the real backend started with --max-model-len 2048
refuses the 2,230 completion tokens the default outline used to ask for, and the default pipeline still completes
against it, each request sized from the max_model_len its /v1/models lists and the prompt /tokenize counts."""

import asyncio
import json

import httpx
import pytest

from common.settings import Settings
from orchestrator.clients import completion_budget
from orchestrator.clients.llm_client import LLMError
from orchestrator.clients.router import LLMRouter
from orchestrator.pipeline.params import ArticleParams
from orchestrator.pipeline.research import messages_for
from tests.backend.server_process import ServerProcess
from tests.backend.tiny_models import build_model
from tests.orchestrator.conftest import run_cli

WINDOW = 2048


@pytest.fixture(scope="module")
def short_server(tmp_path_factory):
    model = build_model("llama", tmp_path_factory.mktemp("models") / "tiny", max_position_embeddings=4096)
    # refusing as vLLM does a max_tokens past the context (ours clamps by default): what the fitting is for
    server = ServerProcess(f"tiny={model}", "--max-model-len", str(WINDOW), "--max-tokens-past-context", "refuse")
    yield server
    server.stop()


def test_the_server_refuses_what_the_default_outline_used_to_ask_for(short_server):
    messages = messages_for(ArticleParams(topic="the history of paper"), [])
    asked = httpx.post(f"{short_server.url}/v1/chat/completions",
                       json={"messages": messages, "max_tokens": 150 + 520 * 4}, timeout=60)
    assert asked.status_code == 400 and "maximum context length is 2048" in asked.text


def test_fit_sizes_a_request_from_models_and_tokenize(short_server):
    messages = messages_for(ArticleParams(topic="the history of paper"), [])

    async def go():
        async with LLMRouter([f"{short_server.url}/v1"]) as router:
            window = await completion_budget.context_window(router)
            used = await completion_budget.prompt_tokens(router, messages)
            return window, used, await completion_budget.fit(router, messages, 2230), await completion_budget.fit(router, messages, 80)

    window, used, fitted, small = asyncio.run(go())
    counted = httpx.post(f"{short_server.url}/tokenize", json={"messages": messages}, timeout=30).json()["count"]
    assert window == WINDOW and used == counted and fitted == WINDOW - used
    assert small == 80  # a request that fits is left as asked


def test_a_prompt_that_fills_the_context_is_an_error_naming_it(short_server):
    messages = [{"role": "user", "content": "paper and ink " * 700}]

    async def go():
        async with LLMRouter([f"{short_server.url}/v1"]) as router:
            await completion_budget.fit(router, messages, 100)

    with pytest.raises(LLMError, match="of the model's 2048 tokens of context"):
        asyncio.run(go())


def test_the_default_pipeline_completes_against_a_2048_token_server(tmp_path, short_server):
    settings = Settings(home=tmp_path / "home", llm_urls=(f"{short_server.url}/v1",))
    result = run_cli(settings, "run", "the history of paper", "--images", "0", "--seed", "5", "--json")
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout)
    outline = json.loads((tmp_path / "home" / "runs" / summary["run_id"] / "research.json").read_text())
    assert len(outline["sections"]) == 4  # the default article: 4 sections of 150 words
