"""The start order and memory budgets: dependencies first, then fixed before elastic; refuse what cannot fit.

The LLM server reserves its KV cache up front (fixed); ComfyUI loads and frees models as it goes
(elastic), so it starts last and sees what is left.
"""

from dataclasses import dataclass, field

from common.gpu import Device, fmt
from ops.engines import launch
from ops.service_needs import Need
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
    engine: str | None = None  # the LLM engine it runs (ops/engines.py)
    sleep_api: str = "none"  # how it lends its memory to an image job
    runner: str = "process"
    command: list[str] = field(default_factory=list)  # exactly what ops runs (docker: inside the container)
    image: str | None = None
    env: dict[str, str] | None = None  # what the command gets added to its environment (secrets as ***)
    missing: str | None = None  # process runner: what must be installed first
    need: int | None = None  # bytes its largest model needs, as its engine measured them (ops/service_needs.py)


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
              leases: bool = True, runner: str = "process", needs: dict[str, Need] | None = None) -> Plan:
    running = running or set()
    needs = needs or {}
    ordered = order(services)
    device = devices[0] if devices else None  # one card: the stack's services share it
    free = device.free if device else 0
    lendable = 0  # memory of services before this one that can sleep to lend it (leases)
    llms = [s for s in ordered if s.engine]  # LLM services: those that run one of ops/engines.py's engines
    steps, problems = [], []
    for s in ordered:
        if device is not None and s.gpu_memory == "auto" and s.need is None:
            why = needs[s.name].why if s.name in needs else "it was not measured"
            problems.append(f"{s.name}: x-ops.gpu_memory is auto, but its need could not be measured ({why}); give "
                            f"it a size (18GiB) or a fraction of the card (0.45)")
            continue
        how = launch(s, runner, device.total if device else None)
        extra = dict(engine=s.engine, sleep_api=s.sleep_api, runner=runner, command=how.command, image=how.image,
                     env=how.env, missing=how.missing, need=s.need)
        if device is None:  # the embedded default: everything on the CPU
            steps.append(Step(s.name, s.memory, 0, None, None, s.name in running, **extra))
            continue
        budget = s.budget(device.total) if s.gpu or s.gpu_memory else 0
        note = ""
        if s.name in running:
            steps.append(Step(s.name, s.memory, budget, free, free, True, **extra))
            lendable += budget if s.can_sleep else 0
            continue
        unsleeping = [x for x in llms if not x.can_sleep and x.name != s.name]
        if budget > 0 and budget > free:
            if leases and s.memory == "elastic" and budget <= free + lendable:
                note = "fits while the LLM sleeps: its jobs take a memory lease"
            else:
                problems.append(_explain(s, budget, free, device, running, leases, unsleeping))
        elif s.memory == "elastic" and budget > 0 and unsleeping:
            note = f"fits beside {', '.join(x.name for x in unsleeping)} (sleep_api: none: no memory leases)"
        steps.append(Step(s.name, s.memory, budget, free, free - budget, False, note, **extra))
        free -= budget
        lendable += budget if s.can_sleep else 0
    return Plan(steps, device, problems)


def _explain(service: Service, budget: int, free: int, device: Device, running: set[str], leases: bool = True,
             unsleeping: list[Service] = ()) -> str:
    line = (f"{service.name} needs {fmt(budget)} of GPU memory but only {fmt(max(free, 0))} will be free on GPU "
            f"{device.index} ({device.name}, {fmt(device.total)})")
    holders = sorted(device.processes, key=lambda p: -p.used)
    if holders:
        line += "; held now by " + ", ".join(f"{p.name} (pid {p.pid}) {fmt(p.used)}" for p in holders[:4])
    if service.memory == "elastic" and leases and unsleeping:
        names = ", ".join(f"{x.name} ({x.engine or 'its engine'})" for x in unsleeping)
        line += (f"; {names} has x-ops.sleep_api: none, so it cannot lend its memory and {service.name}'s budget "
                 f"must fit beside it")
    if service.memory == "elastic":
        line += f"; give {service.name} a smaller x-ops.gpu_memory and run it with --lowvram, or free memory first"
    else:
        line += f"; lower x-ops.gpu_memory for {service.name} (e.g. {fmt(max(free, 0) * 0.9)}) or stop those processes"
    return line
