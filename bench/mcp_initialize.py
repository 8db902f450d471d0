"""How soon `python -m mcp_server` answers: seconds from starting the process (the `mcp` SDK's stdio client
spawns it) to the initialize result, to the tools/list result (both answered by mcp_server/stdio_front.py from
an earlier start's answers) and to a resources/list result (answered by the SDK server once it is loaded), the
median of several starts; and the first start in a new SCRIPTORIUM_HOME, where nothing is remembered yet (its initialize is answered without the SDK).

Agents start their MCP servers with a time limit (Codex: startup_timeout_sec), and a user waits on every
start. No LLM is needed: nothing is asked of the upstream before a tool is called. Prints one JSON line.
--busy N keeps N processes spinning on the CPU meanwhile, a loaded machine (an agent and a model beside us).
Run: python bench/mcp_initialize.py [--runs 7] [--toolsets core] [--busy 2]
"""

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from mcp import ClientSession, StdioServerParameters, stdio_client

ROOT = Path(__file__).resolve().parent.parent


async def one_start(params: StdioServerParameters) -> tuple[float, float, float]:
    started = time.perf_counter()
    async with stdio_client(params) as (read, write), ClientSession(read, write) as session:
        await session.initialize()
        initialized = time.perf_counter()
        await session.list_tools()
        listed = time.perf_counter()
        await session.list_resources()
        loaded = time.perf_counter()
    return initialized - started, listed - started, loaded - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--toolsets", default="core")
    parser.add_argument("--busy", type=int, default=0, help="processes spinning on the CPU during the starts")
    args = parser.parse_args()
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.busy)]
    try:
        first, times = measure(args.runs, args.toolsets)
    finally:
        for spinner in spinners:
            spinner.kill()
            spinner.wait()
    print(json.dumps({"bench": "mcp_initialize", "runs": args.runs, "toolsets": args.toolsets, "busy": args.busy,
                      "cpus": os.cpu_count(), "load_1m": round(os.getloadavg()[0], 2),
                      "initialize_s": round(statistics.median(t[0] for t in times), 3),
                      "tools_list_s": round(statistics.median(t[1] for t in times), 3),
                      "initialize_max_s": round(max(t[0] for t in times), 3),
                      "sdk_loaded_s": round(statistics.median(t[2] for t in times), 3),
                      "first_start_initialize_s": round(first[0], 3), "first_start_tools_list_s": round(first[1], 3)}))


def measure(runs: int, toolsets: str) -> tuple[tuple[float, float, float], list[tuple[float, float, float]]]:
    """The first start in a new home, then `runs` starts that find its answers. A start in a home thrown away
    comes first: the client's own first spawn costs 0.2-0.3 s more on a loaded machine, which is not the server's."""
    with tempfile.TemporaryDirectory() as home:
        env = {**os.environ, "SCRIPTORIUM_HOME": home, "SCRIPTORIUM_MCP_TOOLSETS": toolsets}
        asyncio.run(one_start(StdioServerParameters(command=sys.executable, args=["-m", "mcp_server"],
                                                    cwd=str(ROOT), env=env)))
    with tempfile.TemporaryDirectory() as home:
        env = {**os.environ, "SCRIPTORIUM_HOME": home, "SCRIPTORIUM_MCP_TOOLSETS": toolsets}
        params = StdioServerParameters(command=sys.executable, args=["-m", "mcp_server"], cwd=str(ROOT), env=env)
        first = asyncio.run(one_start(params))
        return first, [asyncio.run(one_start(params)) for _ in range(runs)]


if __name__ == "__main__":
    main()
