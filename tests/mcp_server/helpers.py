"""What the MCP server tests share: settings against the real backend and the ComfyUI stand-in, job polling,
and checking a result against the tool's published outputSchema."""

import asyncio
import time

import jsonschema
from mcp import Client

TOOLS = {"generate_text", "chat", "list_models", "generate_image", "run_workflow", "upload_image",
         "list_image_models", "comfyui_queue", "free_image_memory", "start_pipeline", "get_job", "cancel_job",
         "list_jobs", "stack_status"}
READ_ONLY = {"list_models", "list_image_models", "get_job", "list_jobs", "stack_status"}
DESTRUCTIVE = {"cancel_job", "comfyui_queue"}


async def poll_job(client: Client, job_id: str, timeout: float = 180) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        info = (await client.call_tool("get_job", {"job_id": job_id})).structured_content
        if info["status"] in ("done", "failed", "cancelled"):
            return info
        await asyncio.sleep(0.3)
    raise TimeoutError(job_id)


class Checked:
    """Calls tools and validates every successful result's structuredContent against the tool's outputSchema."""

    def __init__(self, client: Client):
        self.client = client
        self.schemas: dict[str, dict] = {}
        self.validated: set[str] = set()

    async def __call__(self, name: str, arguments: dict | None = None, **kwargs):
        if not self.schemas:
            self.schemas = {t.name: t.output_schema for t in (await self.client.list_tools()).tools}
        result = await self.client.call_tool(name, arguments or {}, **kwargs)
        if not result.is_error:
            assert self.schemas[name] is not None, f"{name} publishes no outputSchema"
            jsonschema.validate(result.structured_content, self.schemas[name])
            self.validated.add(name)
        return result
