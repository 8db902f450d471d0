"""stack_status over several LLM upstreams: each one's health, models, requests in flight and answered, and when
it last failed, as the MCP server's router sees them (one of them not running)."""

import asyncio
import time

from mcp import Client

from common.settings import Settings
from mcp_server.server import build_server
from tests.backend.server_process import free_port
from tests.mcp_server.helpers import Checked


def test_stack_status_shows_each_upstream_as_the_router_sees_it(tmp_path, llm_server):
    dead, live = f"http://127.0.0.1:{free_port()}/v1", f"{llm_server.url}/v1"
    settings = Settings(home=tmp_path / "home", llm_urls=(dead, live), llm_backoff=30)

    async def go():
        async with Client(build_server(settings, budget=60)) as client:
            call = Checked(client)
            text = await call(
                "generate_text", {"prompt": "Write about ink.", "max_tokens": 8, "temperature": 0}
            )
            assert not text.is_error and text.structured_content["text"]
            status = (await call("stack_status")).structured_content
            rows = {row["url"]: row for row in status["llm"]}
            assert list(rows) == [dead, live]
            down, up = rows[dead], rows[live]
            assert down["healthy"] is False and "ConnectError" in down["error"] and down["models"] == []
            assert time.time() - 60 < down["last_failure"] <= time.time() < down["ejected_until"]
            assert up["healthy"] and up["models"] == ["tiny", "tiny-qwen"] and up["error"] is None
            assert (up["in_flight"], up["served"], up["last_failure"]) == (0, 1, None)

    asyncio.run(go())
