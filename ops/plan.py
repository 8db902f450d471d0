"""The start order and memory budgets: dependencies first, then fixed before elastic; refuse what cannot fit.

The LLM server reserves its KV cache up front (fixed); ComfyUI loads and frees models as it goes
(elastic), so it starts last and sees what is left.
"""

from dataclasses import dataclass, field

from common.gpu import Device, fmt
from ops.stack import Service, StackError


@dataclass
class Step:
    service: str
    memory: str
    budget: int  # bytes on the card (0 on the CPU)
    free_before: int | None  # what the card will have free when this service starts (None: no GPU)
    free_after: int | None
    running: bool  # already running: it holds its memory, nothing to start
    note: str = ""


@dataclass
class Plan:
    steps: list[Step]
    device: Device | None
    problems: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {"device": self.device.to_dict() if self.device else None,
                "steps": [s.__dict__ for s in self.steps], "problems": self.problems, "fits": not self.problems}


def order(services: list[Service]) -> list[Service]:
    """Topological order over depends_on; among services that are ready, fixed memory before elastic."""
    by_name = {s.name: s for s in services}
    index = {s.name: i for i, s in enumerate(services)}
    done: list[Service] = []
    placed: set[str] = set()
    while len(done) < len(services):
        ready = [s for s in services if s.name not in placed and all(d in placed or d not in by_name
                                                                          for d in s.depends_on)]
        if not ready:
            cycle = ", ".join(s.name for s in services if s.name not in placed)
            raise StackError(f"services depend on each other in a cycle: {cycle}")
        ready.sort(key=lambda s: (s.memory != "fixed", index[s.name]))
        done.append(ready[0])
        placed.add(ready[0].name)
    return done


def make_plan(services: list[Service], devices: list[Device], running: set[str] | None = None,
              leases: bool = True) -> Plan:
    running = running or set()
    ordered = order(services)
    if not devices:  # the embedded default: everything on the CPU
        return Plan([Step(s.name, s.memory, 0, None, None, s.name in running) for s in ordered], None)
    device = devices[0]  # one card: the stack's services share it
    free = device.free
    lendable = 0  # memory of services before this one that can sleep to lend it (leases)
    steps, problems = [], []
    for s in ordered:
        budget = s.budget(device.total) if s.gpu or s.gpu_memory else 0
        note = ""
        if s.name in running:
            steps.append(Step(s.name, s.memory, budget, free, free, True))
            lendable += budget if s.can_sleep else 0
            continue
        if budget > 0 and budget > free:
            if leases and s.memory == "elastic" and budget <= free + lendable:
                note = "fits while the LLM sleeps: its jobs take a memory lease"
            else:
                problems.append(_explain(s, budget, free, device, running))
        steps.append(Step(s.name, s.memory, budget, free, free - budget, False, note))
        free -= budget
        lendable += budget if s.can_sleep else 0
    return Plan(steps, device, problems)


def _explain(service: Service, budget: int, free: int, device: Device, running: set[str]) -> str:
    line = (f"{service.name} needs {fmt(budget)} of GPU memory but only {fmt(max(free, 0))} will be free on GPU "
            f"{device.index} ({device.name}, {fmt(device.total)})")
    holders = sorted(device.processes, key=lambda p: -p.used)
    if holders:
        line += "; held now by " + ", ".join(f"{p.name} (pid {p.pid}) {fmt(p.used)}" for p in holders[:4])
    if service.memory == "elastic":
        line += f"; give {service.name} a smaller x-ops.gpu_memory and run it with --lowvram, or free memory first"
    else:
        line += f"; lower x-ops.gpu_memory for {service.name} (e.g. {fmt(max(free, 0) * 0.9)}) or stop those processes"
    return line
