"""Per-stage sampling overrides through the MCP server's HTTP transport (a real process, the SDK client): what
create_run and start_pipeline record for the stages to read."""

import asyncio

from orchestrator.jobs import JobStore
from orchestrator.pipeline.sampling import DEFAULTS
from tests.mcp_server.helpers import Checked
from tests.mcp_server.run_server import agent


def test_sampling_overrides_are_recorded_by_create_run_and_start_pipeline(served):
    """`sampling` on create_run and start_pipeline lays over the stage defaults and is recorded in the run's
    params (what the stages read); a bad override is refused with its name."""
    server, settings, _ = served
    overrides = {"sections": {"temperature": 0.3, "repetition_penalty": 1.2}, "loop_threshold": 0.2}

    async def main():
        async with agent(server, "sampler") as client:
            call = Checked(client)
            created = await call("create_run", {"topic": "quills", "sections": 1, "images": 0,
                                                "sampling": overrides})
            started = await call("start_pipeline", {"topic": "inks", "sections": 1, "images": 0,
                                                    "sampling": overrides})
            refused = await client.call_tool("start_pipeline", {"topic": "x", "sampling": {"sections": {"top_k": 3}}})
            await call("cancel_job", {"job_id": started.structured_content["job_id"]})
            return created.structured_content["run_id"], started.structured_content["job_id"], refused

    run_id, job_id, refused = asyncio.run(main())
    store = JobStore(settings.jobs_db)
    for run in (run_id, job_id):
        sampling = store.get(run).params["sampling"]  # what the stages read
        assert sampling["sections"]["temperature"] == 0.3 and sampling["sections"]["repetition_penalty"] == 1.2
        assert sampling["loop_threshold"] == 0.2
        assert sampling["outline"]["temperature"] == DEFAULTS["outline"].temperature  # the other stages: defaults
        assert sampling["sections"]["top_p"] == DEFAULTS["sections"].top_p  # fields not given keep theirs
    assert refused.is_error and "sampling" in refused.content[0].text
