"""The LLM upstreams for `ops status`: each one asked now (GET /models), with what the routers of the running
processes (the MCP server, job workers) report of it: requests in flight, when it last failed and why, whether it
is taken out for a back-off (common/upstreams.py)."""

import concurrent.futures
import time
from pathlib import Path

import httpx

from common import upstreams as board


def _ask(url: str, timeout: float) -> tuple[bool, list[str], str | None]:
    try:
        response = httpx.get(f"{url}/models", timeout=timeout)
        response.raise_for_status()
        return True, [m["id"] for m in response.json().get("data", [])], None
    except (httpx.HTTPError, ValueError, KeyError, TypeError) as e:
        return False, [], f"{type(e).__name__}: {e}"


def report(home: Path, urls: list[str], timeout: float = 3.0) -> list[dict]:
    """One row per upstream (the configured ones, then any other a router reports)."""
    known = board.read(home)
    every = list(dict.fromkeys([*urls, *known]))
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, min(8, len(every)))) as pool:
        answers = list(pool.map(lambda u: _ask(u, timeout), every))
    rows = []
    for url, (healthy, models, error) in zip(every, answers):
        seen = known.get(url, {})
        rows.append({"url": url, "healthy": healthy, "models": models or seen.get("models", []),
                     "error": error, "in_flight": seen.get("in_flight", 0), "served": seen.get("served", 0),
                     "routers": seen.get("processes", 0), "last_failure": seen.get("last_failure"),
                     "last_error": seen.get("error"), "ejected_until": seen.get("ejected_until")})
    return rows


def lines(rows: list[dict]) -> list[str]:
    out = [f"{'UPSTREAM':<34} {'HEALTH':<8} {'IN FLIGHT':>9}  {'MODELS':<20} LAST FAILURE"]
    for r in rows:
        when = time.strftime("%H:%M:%S", time.localtime(r["last_failure"])) if r["last_failure"] else "-"
        if r["last_failure"] and r["last_error"]:
            when += f" ({r['last_error'][:60]})"
        if r["ejected_until"]:
            when += f"; left out for {max(r['ejected_until'] - time.time(), 0):.0f} s more"
        health = "healthy" if r["healthy"] else "down"
        out.append(f"{r['url']:<34} {health:<8} {r['in_flight']:>9}  {','.join(r['models'])[:20] or '-':<20} {when}")
    return out
