"""What a server holds, read from outside: its Prometheus gauges and its process's resident memory."""

import re

import httpx


def metrics(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    values = {}
    for name, labels, value in re.findall(r"^([a-z_]+)(\{[^}]*\})? ([0-9.e+-]+|NaN)$", text, re.M):
        values[name + (labels or "")] = float(value)
        if labels:  # and summed over its labels (every sample carries its model) under the bare name
            values[name] = values.get(name, 0.0) + float(value)
    return values


def idle(url: str) -> dict[str, float]:
    """The gauges that say a server holds nothing for any request."""
    m = metrics(url)
    return {"running": m["scriptorium_requests_running"], "waiting": m["scriptorium_requests_waiting"],
            "kv_cache_usage": m["scriptorium_kv_cache_usage_ratio"]}


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")
