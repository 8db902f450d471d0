"""generate_text and chat against the real backend: the model that answered and the token count come from the
server (its response's `model` and its usage), checked against the same request made with the official client."""

import asyncio

import pytest
from mcp import Client
from openai import OpenAI

from common.settings import Settings
from mcp_server.server import build_server
from tests.backend.server_process import free_port

PROMPT = "Write about ink."


@pytest.mark.parametrize("upstreams", ["one", "two"])  # one client alone, or the router choosing between two
def test_the_answering_model_and_the_servers_token_count(tmp_path, llm_server, upstreams):
    live = f"{llm_server.url}/v1"
    urls = (live,) if upstreams == "one" else (f"http://127.0.0.1:{free_port()}/v1", live)
    settings = Settings(home=tmp_path / "home", llm_urls=urls)  # no llm_model: the upstream's default answers
    oracle = OpenAI(base_url=live, api_key="none").chat.completions.create(
        model=llm_server_default(live), messages=[{"role": "user", "content": PROMPT}], max_tokens=12,
        temperature=0)

    async def go():
        async with Client(build_server(settings, budget=60)) as client:
            text = await client.call_tool("generate_text", {"prompt": PROMPT, "max_tokens": 12, "temperature": 0})
            chat = await client.call_tool("chat", {"messages": [{"role": "user", "content": PROMPT}],
                                                   "max_tokens": 12, "temperature": 0})
            return text.structured_content, chat.structured_content

    for result in asyncio.run(go()):
        assert result["model"] == oracle.model
        assert result["tokens"] == oracle.usage.completion_tokens and result["text"] == oracle.choices[0].message.content


def llm_server_default(url: str) -> str:
    """The first model the upstream lists: what answers when a request names none of ours."""
    return OpenAI(base_url=url, api_key="none").models.list().data[0].id
