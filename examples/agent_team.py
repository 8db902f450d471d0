"""A content team of four agents sharing one Scriptorium run, each a plain loop over the `mcp` SDK client in a
process of its own, against the MCP server's HTTP transport:

  research agent     research, then tidies the outline and sets it (the hand-off to the others)
  writing agent      write_sections; rewrites any section the integration agent rejects
  image agent        illustrate
  integration agent  reviews the sections, rejects the shortest one once, waits for its rewrite, assembles

python examples/agent_team.py [--url http://127.0.0.1:8765/mcp] [--topic ...]   prints the article's path.
Real agents (Claude Code, Codex, Hermes, ...) would load the server's research_agent, writing_agent,
image_agent and integration_agent prompts instead of these loops.
"""

import argparse
import asyncio
import os
import subprocess
import sys
import time
from contextlib import asynccontextmanager

import httpx2
from mcp import Client
from mcp.client.streamable_http import streamable_http_client
from mcp.types import Implementation

ROLES = ("research", "writing", "image", "integration")
REJECTION = "Too thin: give one concrete example and say why it matters."


@asynccontextmanager
async def connect(url: str, role: str):
    """An SDK client named after the role: the run's history records each change under that name."""
    token = os.environ.get("SCRIPTORIUM_MCP_TOKEN")
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    async with (
        httpx2.AsyncClient(headers=headers, timeout=httpx2.Timeout(30, read=120)) as http,
        Client(
            streamable_http_client(url, http_client=http),
            client_info=Implementation(name=f"{role}-agent", version="1.0"),
        ) as client,
    ):
        yield client


class Agent:
    def __init__(self, client: Client, run_id: str, timeout: float):
        self.client = client
        self.run_id = run_id
        self.deadline = time.monotonic() + timeout

    async def call(self, tool: str, **arguments) -> dict:
        result = await self.client.call_tool(tool, {"run_id": self.run_id, **arguments})
        if result.is_error:
            raise RuntimeError(f"{tool}: {result.content[0].text}")
        outcome = result.structured_content
        while outcome.get("job_id") and outcome.get("status") in ("queued", "running"):  # a long stage
            await asyncio.sleep(1)
            outcome = (
                await self.client.call_tool("get_job", {"job_id": outcome["job_id"]})
            ).structured_content
        if outcome.get("status") in ("failed", "cancelled", "interrupted"):
            raise RuntimeError(f"{tool} ended {outcome['status']}: {outcome.get('error')}")
        return outcome

    async def run(self) -> dict:
        return await self.call("get_run")

    async def until(self, ready) -> dict:
        """The run once ready(run) holds, looking every second."""
        while time.monotonic() < self.deadline:
            state = await self.run()
            if ready(state):
                return state
            await asyncio.sleep(1)
        raise TimeoutError("the team did not hand the run on in time")


def handed_off(state: dict) -> bool:
    """The research agent's outline is set (its last step), so the others may start."""
    outline = state["outline"]
    return outline["status"] == "done" and (outline["changed_by"] or {}).get("tool") == "set_outline"


async def research(agent: Agent) -> None:
    await agent.call("research")
    outline = (await agent.run())["outline"]

    def tidied(text: str, longest: int, shortest: int, otherwise: str) -> str:
        text = " ".join(text.split()).rstrip(".")[:longest]
        return text if len(text) >= shortest else otherwise  # the outline's schema sets the lengths

    tidy = {
        "title": tidied(outline["title"], 80, 3, "An article"),
        "sections": [
            {
                "heading": tidied(s["heading"], 60, 2, f"Part {i + 1}"),
                "key_points": [
                    tidied(p, 120, 3, f"point {n + 1}") for n, p in enumerate(s["key_points"][:3])
                ],
            }
            for i, s in enumerate(outline["sections"])
        ],
    }
    await agent.call("set_outline", outline=tidy, expected_version=outline["version"])


async def writing(agent: Agent) -> None:
    await agent.until(handed_off)
    await agent.call("write_sections")
    while True:  # until the article is assembled: rewrite what the integration agent sends back
        state = await agent.until(
            lambda s: (
                s["outputs"]["status"] == "done"
                or any(x["status"] in ("rejected", "stale") for x in s["sections"])
            )
        )
        if state["outputs"]["status"] == "done":
            return
        for section in state["sections"]:
            if section["status"] == "stale":
                await agent.call("write_section", index=section["index"])
        if any(x["status"] == "rejected" for x in state["sections"]):
            await agent.call("write_sections")  # rewrites the rejected ones from their reasons


async def image(agent: Agent) -> None:
    await agent.until(handed_off)
    await agent.call("illustrate")


async def integration(agent: Agent) -> str:
    def complete(state: dict) -> bool:
        return (
            handed_off(state)
            and all(s["status"] == "done" for s in state["sections"])
            and all(i["status"] in ("done", "skipped") for i in state["images"])
        )

    state = await agent.until(complete)
    weakest = min(state["sections"], key=lambda s: (s["words"], s["index"]))
    await agent.call(
        "reject_section", index=weakest["index"], reason=REJECTION, expected_version=weakest["version"]
    )
    await agent.until(
        lambda s: complete(s) and s["sections"][weakest["index"]]["version"] > weakest["version"]
    )
    assembled = await agent.call("assemble")
    article = assembled["result"]["article"]
    return article["article_html"] or article["article_md"]


async def play(url: str, role: str, run_id: str, timeout: float) -> str | None:
    async with connect(url, role) as client:
        agent = Agent(client, run_id, timeout)
        return await {"research": research, "writing": writing, "image": image, "integration": integration}[
            role
        ](agent)


async def create(url: str, topic: str, sections: int, words: int) -> str:
    async with connect(url, "team-lead") as client:
        result = await client.call_tool(
            "create_run", {"topic": topic, "sections": sections, "images": 2, "words_per_section": words}
        )
        if result.is_error:
            raise RuntimeError(result.content[0].text)
        return result.structured_content["run_id"]


def reason(error: BaseException) -> str:
    """The error under the SDK's task groups, named when its message is empty (a refused connection, a timeout)."""
    while isinstance(error, BaseExceptionGroup) and error.exceptions:
        error = error.exceptions[0]
    return f"{type(error).__name__}: {error}" if str(error) else type(error).__name__


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python examples/agent_team.py")
    parser.add_argument(
        "--url", default=f"http://127.0.0.1:{os.environ.get('SCRIPTORIUM_MCP_PORT', '8765')}/mcp"
    )
    parser.add_argument("--topic", default="How medieval scriptoria copied books")
    parser.add_argument("--sections", type=int, default=3)
    parser.add_argument("--words", type=int, default=120)
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--role", choices=ROLES, help=argparse.SUPPRESS)  # one agent's process
    parser.add_argument("--run", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    try:
        if args.role:
            try:
                article = asyncio.run(play(args.url, args.role, args.run, args.timeout))
            except Exception as e:  # noqa: BLE001 this agent's one line, above the team's summary
                print(f"error: the {args.role} agent: {reason(e)}", file=sys.stderr)
                return 1
            if article:
                print(article)
            return 0
        run_id = asyncio.run(create(args.url, args.topic, args.sections, args.words))
        print(f"run {run_id}: starting the research, writing, image and integration agents", file=sys.stderr)
        agents = {
            role: subprocess.Popen(
                [
                    sys.executable,
                    __file__,
                    "--url",
                    args.url,
                    "--role",
                    role,
                    "--run",
                    run_id,
                    "--timeout",
                    str(args.timeout),
                ],
                stdout=subprocess.PIPE,
                text=True,
            )
            for role in ROLES
        }
        outs = {role: proc.communicate()[0] for role, proc in agents.items()}
    except Exception as e:  # noqa: BLE001 one line for the person at the terminal
        print(f"error: {reason(e)}", file=sys.stderr)
        return 1
    failed = [role for role, proc in agents.items() if proc.returncode != 0]
    if failed:
        print(f"error: the {', '.join(failed)} agent(s) failed (their errors are above)", file=sys.stderr)
        return 1
    print(outs["integration"].strip())
    return 0


if __name__ == "__main__":
    sys.exit(main())
