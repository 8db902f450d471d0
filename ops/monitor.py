"""`ops monitor`: GPU memory per device and process, temperature, and each service's health, live."""

import time

from common import gpu
from common.gpu import fmt
from ops import lifecycle
from ops.service_records import State
from ops.stack import Stack


def snapshot(stack: Stack) -> dict:
    devices, source = gpu.probe()
    state = State(lifecycle.home())
    services = [lifecycle.service_status(s, state, stack).__dict__ for s in stack.services.values()]
    return {"time": time.time(), "gpu": {"source": source, "devices": [
        {**d.to_dict(), "used": d.total - d.free} for d in devices]}, "services": services}


def render(data: dict):
    from rich.console import Group
    from rich.table import Table

    gpus = Table(title="GPU memory", expand=True)
    for column in ("GPU", "name", "used", "free", "total", "temp", "processes"):
        gpus.add_column(column)
    for d in data["gpu"]["devices"]:
        procs = ", ".join(f"{p['name']}[{p['pid']}] {fmt(p['used'])}" for p in d["processes"]) or "-"
        temp = f"{d['temperature']}°C" if d.get("temperature") is not None else "-"
        gpus.add_row(str(d["index"]), d["name"], fmt(d["used"]), fmt(d["free"]), fmt(d["total"]), temp, procs)
    if not data["gpu"]["devices"]:
        gpus.add_row("-", "no GPU (probe: " + data["gpu"]["source"] + ")", "", "", "", "", "")
    services = Table(title="services", expand=True)
    for column in ("service", "state", "runner", "pid/container", "detail"):
        services.add_column(column)
    colours = {"healthy": "green", "unhealthy": "yellow", "dead": "red", "stopped": "dim"}
    for s in data["services"]:
        ident = str(s["pid"] or (s["container"] or "")[:12] or "-")
        services.add_row(s["service"], f"[{colours.get(s['state'], 'white')}]{s['state']}", s["runner"] or "-",
                         ident, s["detail"])
    return Group(gpus, services)


def live(stack: Stack, interval: float) -> None:
    from rich.live import Live

    with Live(render(snapshot(stack)), refresh_per_second=4, screen=False) as view:
        while True:
            time.sleep(interval)
            view.update(render(snapshot(stack)))
