"""Toolsets as a real `mcp` client sees them over stdio: what each set lists, what the default costs in the
default model's tokens, that a tool outside the chosen sets cannot be called, and that unknown names fail."""

import asyncio
import json
import os
import subprocess
import sys

import pytest
from mcp import Client, StdioServerParameters

from tests.backend.server_process import ROOT, free_port

# The sets as issue 33 describes them, written out here rather than imported from the server.
CORE = {"generate_text", "chat", "list_models", "generate_image", "start_pipeline", "get_job", "cancel_job",
        "list_jobs", "stack_status"}
TEAM = {"create_run", "get_run", "research", "set_outline", "write_sections", "write_section", "set_section",
        "reject_section", "illustrate", "set_image", "assemble", "get_job", "cancel_job"}
IMAGES = {"generate_image", "run_workflow", "upload_image", "list_image_models", "comfyui_queue",
          "free_image_memory", "get_job", "cancel_job"}
ROLE_PROMPTS = {"research_agent", "writing_agent", "image_agent", "integration_agent"}
BUDGET = 2000  # tokens of SmolLM2's tokenizer the default toolset's tools/list may cost


def env(tmp_path, toolsets: str | None = None) -> dict:
    env = {**os.environ, "SCRIPTORIUM_HOME": str(tmp_path / "home"),
           "SCRIPTORIUM_LLM_URL": f"http://127.0.0.1:{free_port()}/v1"}
    env.pop("SCRIPTORIUM_MCP_TOOLSETS", None)
    if toolsets is not None:
        env["SCRIPTORIUM_MCP_TOOLSETS"] = toolsets
    return env


def stdio(tmp_path, *args: str, toolsets: str | None = None) -> StdioServerParameters:
    return StdioServerParameters(command=sys.executable, args=["-m", "mcp_server", *args], cwd=str(ROOT),
                                 env=env(tmp_path, toolsets))


async def listing(params: StdioServerParameters) -> tuple[list, set[str]]:
    async with Client(params) as client:
        tools = (await client.list_tools()).tools
        prompts = {p.name for p in (await client.list_prompts()).prompts}
    return tools, prompts


@pytest.fixture(scope="module")
def tokenizer(smollm2_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(smollm2_path.parent), gguf_file=smollm2_path.name)


def test_the_default_toolset_costs_at_most_2000_tokens(tmp_path, tokenizer):
    tools, prompts = asyncio.run(listing(stdio(tmp_path)))
    assert {t.name for t in tools} == CORE
    cost = sum(len(tokenizer.encode(json.dumps({"name": t.name, "description": t.description,
                                                "inputSchema": t.input_schema}))) for t in tools)
    assert cost <= BUDGET, f"the default toolset costs {cost} tokens, more than {BUDGET}"
    assert all(t.output_schema for t in tools)
    assert "write_article" in prompts and not prompts & ROLE_PROMPTS  # the roles need the team's tools


@pytest.mark.parametrize(("chosen", "expected"), [
    ("core", CORE), ("team", TEAM), ("images", IMAGES), ("core,team", CORE | TEAM), ("all", CORE | TEAM | IMAGES)])
def test_each_toolset_lists_exactly_its_tools(tmp_path, chosen, expected):
    tools, prompts = asyncio.run(listing(stdio(tmp_path, toolsets=chosen)))
    assert {t.name for t in tools} == expected
    assert (prompts >= ROLE_PROMPTS) == ("create_run" in expected)


def test_the_flag_chooses_over_the_environment(tmp_path):
    tools, _ = asyncio.run(listing(stdio(tmp_path, "--toolsets", "images", toolsets="team")))
    assert {t.name for t in tools} == IMAGES


def test_a_tool_outside_the_chosen_sets_is_not_callable(tmp_path):
    async def go():
        async with Client(stdio(tmp_path)) as client:
            return await client.call_tool("free_image_memory", {})

    result = asyncio.run(go())
    text = result.content[0].text
    assert result.is_error and "free_image_memory is in the images toolset" in text
    assert "--toolsets core,images" in text and "SCRIPTORIUM_MCP_TOOLSETS" in text


@pytest.mark.parametrize("how", ["flag", "env"])
def test_an_unknown_toolset_fails_naming_the_valid_ones(tmp_path, how):
    args = ["--toolsets", "core,imgs"] if how == "flag" else []
    done = subprocess.run([sys.executable, "-m", "mcp_server", *args], cwd=ROOT, capture_output=True, text=True,
                          env=env(tmp_path, "core,imgs" if how == "env" else None), stdin=subprocess.DEVNULL,
                          timeout=60)
    assert done.returncode == 2 and not done.stdout
    assert "unknown toolset 'imgs'" in done.stderr and "core, team, images, all" in done.stderr
