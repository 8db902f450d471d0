"""Shared runs through the MCP server's HTTP transport as a real process, with the SDK client, the real backend and
the ComfyUI stand-in: agents with distinct client names each doing their stage, versions that refuse stale
edits, concurrent writers, a worker killed mid-stage, and the role prompts."""

import asyncio
import os
import signal
import time
from pathlib import Path

import jsonschema
from PIL import Image

from orchestrator.jobs import JobStore
from tests.mcp_server.helpers import Checked
from tests.mcp_server.run_server import agent
from tests.serving import wait_for

ROLES = ["research_agent", "writing_agent", "image_agent", "integration_agent"]


async def finished(call: Checked, result) -> dict:
    """A stage's outcome once its job is done (the call returns within its budget; a slow one is polled)."""
    assert not result.is_error, result.content[0].text
    outcome = result.structured_content
    deadline = time.monotonic() + 300
    while (
        outcome["status"] not in ("done", "failed", "cancelled", "interrupted")
        and time.monotonic() < deadline
    ):
        await asyncio.sleep(0.5)
        outcome = (await call("get_job", {"job_id": outcome["job_id"]})).structured_content
    assert outcome["status"] == "done", outcome
    return outcome


async def state(call: Checked, run_id: str) -> dict:
    result = await call("get_run", {"run_id": run_id})  # Checked validates it against get_run's outputSchema
    assert not result.is_error, result.content[0].text
    return result.structured_content


def test_four_agents_each_do_their_stage(served):
    server, settings, allowed = served
    photo = allowed / "harbour.jpg"
    checks: list[Checked] = []

    def checked(client) -> Checked:  # each agent's calls, validated against the tools' outputSchemas
        checks.append(Checked(client))
        return checks[-1]
    Image.new("RGB", (96, 64), "teal").save(photo, "JPEG")

    async def research():
        async with agent(server, "researcher") as client:
            call = checked(client)
            created = await call(
                "create_run", {"topic": "lighthouses", "sections": 2, "images": 2, "words_per_section": 40}
            )
            run_id = created.structured_content["run_id"]
            await finished(call, await call("research", {"run_id": run_id}))
            outline = (await state(call, run_id))["outline"]
            assert outline["version"] == 1 and outline["status"] == "done"
            edited = {
                "title": "Keepers of the Light",
                "sections": [
                    {"heading": "Fresnel's Lens", "key_points": ["rings of prisms", "visible for miles"]},
                    {
                        "heading": "Lives on the Rock",
                        "key_points": ["long watches", "storms and supply boats"],
                    },
                ],
            }
            done = await call("set_outline", {"run_id": run_id, "outline": edited, "expected_version": 1})
            assert done.structured_content["version"] == 2
            return run_id, edited

    async def late_editor(run_id: str):
        async with agent(server, "late-editor") as client:
            call = checked(client)
            refused = await call(
                "set_outline",
                {
                    "run_id": run_id,
                    "expected_version": 1,
                    "outline": {
                        "title": "Overwritten",
                        "sections": [{"heading": "Gone", "key_points": ["one", "two"]}] * 2,
                    },
                },
            )
            assert (
                refused.is_error
                and "at version 2 (by researcher with set_outline), not 1" in refused.content[0].text
            )
            return (await state(call, run_id))["outline"]

    async def write(run_id: str):
        async with agent(server, "writer") as client:
            call = checked(client)
            await finished(call, await call("write_sections", {"run_id": run_id}))
            sections = (await state(call, run_id))["sections"]
            assert [(s["status"], s["outline_version"]) for s in sections] == [("done", 2), ("done", 2)]
            return sections

    async def illustrate(run_id: str):
        async with agent(server, "illustrator") as client:
            call = checked(client)
            await finished(call, await call("illustrate", {"run_id": run_id, "index": 0}))
            refused = await call("set_image", {"run_id": run_id, "index": 1, "image": "/etc/hostname"})
            assert refused.is_error and "SCRIPTORIUM_MCP_ALLOWED_DIRS" in refused.content[0].text
            done = await call(
                "set_image", {"run_id": run_id, "index": 1, "image": str(photo), "prompt": "a teal harbour"}
            )
            assert done.structured_content["version"] == 1
            return (await state(call, run_id))["images"]

    async def rewrite(run_id: str, first: str):
        async with agent(server, "writer") as client:
            call = checked(client)
            await finished(
                call,
                await call(
                    "write_section",
                    {"run_id": run_id, "index": 1, "instructions": "Describe one keeper's night in detail."},
                ),
            )
            section = (await state(call, run_id))["sections"][1]
            assert section["version"] == 2 and section["text"] != first
            return section["text"]

    async def integrate(run_id: str):
        async with agent(server, "integrator") as client:
            call = checked(client)
            outcome = await finished(call, await call("assemble", {"run_id": run_id}))
            return outcome["result"]["article"], await state(call, run_id)

    async def go():
        run_id, edited = await research()
        outline = await late_editor(run_id)
        assert (
            outline["title"] == edited["title"] and outline["version"] == 2
        )  # nothing lost, nothing overwritten
        sections = await write(run_id)
        images = await illustrate(run_id)
        assert [(i["status"], i["changed_by"]["tool"]) for i in images] == [
            ("done", "illustrate"),
            ("done", "set_image"),
        ]
        rewritten = await rewrite(run_id, sections[1]["text"])
        article, final = await integrate(run_id)
        return edited, sections, rewritten, article, final

    edited, sections, rewritten, article, final = asyncio.run(go())
    md = Path(article["article_md"]).read_text()
    assert (
        md.startswith("# Keepers of the Light") and "## Fresnel's Lens" in md and "## Lives on the Rock" in md
    )
    assert (
        rewritten.strip() in md
        and sections[1]["text"].strip() not in md
        and sections[0]["text"].strip() in md
    )
    assert md.count("](images/") == 2 and len(article["images"]) == 2
    html = Path(article["article_html"]).read_text()
    assert html.count('src="data:image/png;base64,') == 2 and "a teal harbour" in html
    who = {(e["client"], e["tool"]) for e in final["history"]}
    assert who == {
        ("researcher", "research"),
        ("researcher", "set_outline"),
        ("writer", "write_sections"),
        ("writer", "write_section"),
        ("illustrator", "illustrate"),
        ("illustrator", "set_image"),
        ("integrator", "assemble"),
    }
    assert final["outputs"]["status"] == "done" and final["outputs"]["markdown"] == article["article_md"]
    assert {
        "create_run",
        "research",
        "set_outline",
        "get_run",
        "write_sections",
        "write_section",
        "illustrate",
        "set_image",
        "assemble",
    } <= set().union(*(c.validated for c in checks))


def test_two_clients_write_different_sections_at_once(served):
    server, _, _ = served

    async def go():
        async with agent(server, "planner") as client:
            call = Checked(client)
            run_id = (
                await call(
                    "create_run", {"topic": "tide mills", "sections": 2, "images": 0, "words_per_section": 40}
                )
            ).structured_content["run_id"]
            await finished(call, await call("research", {"run_id": run_id}))

        async def one(name: str, index: int):
            async with agent(server, name) as client:
                call = Checked(client)
                return await finished(call, await call("write_section", {"run_id": run_id, "index": index}))

        outcomes = await asyncio.gather(one("writer-a", 0), one("writer-b", 1))
        async with agent(server, "reader") as client:
            return outcomes, await state(Checked(client), run_id)

    outcomes, final = asyncio.run(go())
    assert [o["result"]["changed"][0]["part"] for o in outcomes] == ["write:00", "write:01"]
    assert [(s["status"], s["version"], s["changed_by"]["client"]) for s in final["sections"]] == [
        ("done", 1, "writer-a"),
        ("done", 1, "writer-b"),
    ]
    assert all(s["text"] for s in final["sections"])


def test_a_killed_write_sections_is_finished_by_the_same_call(served):
    server, settings, _ = served
    store = JobStore(settings.jobs_db)

    async def go():
        async with agent(server, "writer") as client:
            call = Checked(client)
            run_id = (
                await call(
                    "create_run",
                    {"topic": "canal locks", "sections": 4, "images": 0, "words_per_section": 200},
                )
            ).structured_content["run_id"]
            await finished(call, await call("research", {"run_id": run_id}))
            await call(
                "set_section", {"run_id": run_id, "index": 0, "text": "Set by hand.", "expected_version": 0}
            )
            first = asyncio.create_task(call("write_sections", {"run_id": run_id}))
            job = await asyncio.to_thread(
                wait_for,
                lambda: next(
                    (
                        r
                        for r in store.recent(5)
                        if r.kind == "stage" and r.params["stage"] == "write_sections" and r.pid
                    ),
                    None,
                ),
            )
            await asyncio.to_thread(
                wait_for,
                lambda: all(store.step(run_id, f"write:{i:02d}") is not None for i in (1, 2, 3)),
                60,
                0.02,
            )
            landed = {s.name for s in store.steps(run_id) if s.status == "done"}
            os.kill(store.get(job.id).pid, signal.SIGKILL)
            killed = (await first).structured_content
            assert killed["status"] == "interrupted" and "call the same tool again" in killed["message"]
            written = {s.name: s.started for s in store.steps(run_id) if s.status == "done"}
            again = await finished(call, await call("write_sections", {"run_id": run_id}))
            return run_id, landed, written, again, await state(call, run_id)

    run_id, landed, written, again, final = asyncio.run(go())
    assert "write:00" in landed and len(written) < 5  # the outline, the hand-set section, maybe some written
    remade = {c["part"] for c in again["result"]["changed"]}
    assert remade == {f"write:{i:02d}" for i in range(4)} - set(written)  # only what was missing
    after = {s.name: s.started for s in store.steps(run_id)}
    assert all(after[name] == started for name, started in written.items())
    assert [s["version"] for s in final["sections"]] == [1, 1, 1, 1]  # nothing was written twice
    assert final["sections"][0]["text"] == "Set by hand.\n" and all(
        s["status"] == "done" for s in final["sections"]
    )


def test_the_role_prompts_list_and_render(served):
    server, _, _ = served

    async def go():
        async with agent(server, "any") as client:
            listed = {p.name: p for p in (await client.list_prompts()).prompts}
            rendered = {
                name: (await client.get_prompt(name, {"run_id": "20260101-000000-abcdef"}))
                .messages[0]
                .content.text
                for name in ROLES
            }
            fresh = (await client.get_prompt("research_agent", {"topic": "kites"})).messages[0].content.text
            tools = {t.name: t for t in (await client.list_tools()).tools}
            return listed, rendered, fresh, tools

    listed, rendered, fresh, tools = asyncio.run(go())
    assert set(ROLES) <= set(listed) and all(listed[r].description and listed[r].title for r in ROLES)
    finishing = {
        "research_agent": "set_outline",
        "writing_agent": "write_sections",
        "image_agent": "illustrate",
        "integration_agent": "assemble",
    }
    for role, text in rendered.items():
        assert "'20260101-000000-abcdef'" in text and "get_run" in text and "expected_version" in text
        assert finishing[role] in text
        for word in text.replace("(", " ").replace(",", " ").split():
            if word.endswith("_run") or word in finishing.values():  # every tool a role names exists
                assert word in tools, (role, word)
    assert "create_run(topic='kites')" in fresh
    jsonschema.Draft202012Validator.check_schema(tools["get_run"].output_schema)

