"""How soon `python -m mcp_server` answers: seconds from starting the process (the `mcp` SDK's stdio client
spawns it) to the initialize result and to the tools/list result, the median of several starts.

Agents start their MCP servers with a time limit (Codex: startup_timeout_sec), and a user waits on every
start. No LLM is needed: nothing is asked of the upstream before a tool is called. Prints one JSON line.
Run: python bench/mcp_initialize.py [--runs 7] [--toolsets core]
"""

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from mcp import ClientSession, StdioServerParameters, stdio_client

ROOT = Path(__file__).resolve().parent.parent


async def one_start(params: StdioServerParameters) -> tuple[float, float]:
    started = time.perf_counter()
    async with stdio_client(params) as (read, write), ClientSession(read, write) as session:
        await session.initialize()
        initialized = time.perf_counter()
        await session.list_tools()
        listed = time.perf_counter()
    return initialized - started, listed - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--toolsets", default="core")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as home:
        env = {**os.environ, "SCRIPTORIUM_HOME": home, "SCRIPTORIUM_MCP_TOOLSETS": args.toolsets}
        params = StdioServerParameters(command=sys.executable, args=["-m", "mcp_server"], cwd=str(ROOT), env=env)
        asyncio.run(one_start(params))  # the first start also fills Python's bytecode cache: not counted
        times = [asyncio.run(one_start(params)) for _ in range(args.runs)]
    print(json.dumps({"bench": "mcp_initialize", "runs": args.runs, "toolsets": args.toolsets,
                      "initialize_s": round(statistics.median(t[0] for t in times), 3),
                      "tools_list_s": round(statistics.median(t[1] for t in times), 3),
                      "initialize_max_s": round(max(t[0] for t in times), 3)}))


if __name__ == "__main__":
    main()
