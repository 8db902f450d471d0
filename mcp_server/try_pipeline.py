"""What `make up` ends with: one article written through the MCP server's HTTP transport, as an agent would.

python -m mcp_server.try_pipeline [--url http://127.0.0.1:8765/mcp] [--topic ...]
"""

import argparse
import asyncio
import os
import sys
import time
from pathlib import Path

import httpx2
from mcp import Client
from mcp.client.streamable_http import streamable_http_client


async def write_article(url: str, topic: str, sections: int, words: int, images: int, timeout: float) -> dict:
    token = os.environ.get("SCRIPTORIUM_MCP_TOKEN")
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    async with httpx2.AsyncClient(headers=headers, timeout=httpx2.Timeout(30, read=120)) as http, \
            Client(streamable_http_client(url, http_client=http)) as client:
        started = await client.call_tool("start_pipeline", {"topic": topic, "sections": sections, "images": images,
                                                            "words_per_section": words})
        if started.is_error:
            raise RuntimeError(started.content[0].text)
        job_id = started.structured_content["job_id"]
        print(f"job {job_id} started", file=sys.stderr)
        deadline = time.monotonic() + timeout
        last = None
        while time.monotonic() < deadline:
            info = (await client.call_tool("get_job", {"job_id": job_id})).structured_content
            line = f"{info['stage'] or 'queued'} {info['progress'] * 100:.0f}%"
            if line != last:
                print(f"  {line}", file=sys.stderr)
                last = line
            if info["status"] in ("done", "failed", "cancelled", "interrupted"):
                return info
            await asyncio.sleep(1.0)
        raise TimeoutError(f"job {job_id} did not finish within {timeout:.0f} s; follow it with "
                           f"`python -m orchestrator show {job_id}`")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mcp_server.try_pipeline")
    port = os.environ.get("SCRIPTORIUM_MCP_PORT", "8765")
    parser.add_argument("--url", default=f"http://127.0.0.1:{port}/mcp")
    parser.add_argument("--topic", default="How medieval scriptoria copied books")
    parser.add_argument("--sections", type=int, default=int(os.environ.get("SCRIPTORIUM_DEMO_SECTIONS", 3)))
    parser.add_argument("--words", type=int, default=int(os.environ.get("SCRIPTORIUM_DEMO_WORDS", 120)))
    parser.add_argument("--images", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=1800)
    args = parser.parse_args(argv)
    try:
        info = asyncio.run(write_article(args.url, args.topic, args.sections, args.words, args.images, args.timeout))
    except Exception as e:  # noqa: BLE001 one line for the person at the terminal
        print(f"error: {e}", file=sys.stderr)
        return 1
    if info["status"] != "done":
        print(f"error: the article job ended {info['status']}: {info.get('error')}", file=sys.stderr)
        return 1
    result = info["result"]
    if result.get("images_skipped"):
        print(f"note: {result['images_skipped']}", file=sys.stderr)
    print(summary(result))
    return 0


def summary(result: dict) -> str:
    """What a newcomer reads last: the article's title, its length and where it is."""
    words = len(Path(result["article_md"]).read_text(encoding="utf-8").split()) if result.get("article_md") else 0
    return f"{result['title']} ({words} words)\n{result['article_html']}"


if __name__ == "__main__":
    sys.exit(main())
