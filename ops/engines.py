"""The engines the `backend` service can run: ours, vLLM or SGLang.

compose.yaml's backend extends engines/${SCRIPTORIUM_ENGINE:-scriptorium}.yaml, so `docker compose up` and
`ops up` pick the same one. Each engine takes its GPU budget through one flag; vLLM's and SGLang's take a
fraction of the card's *total* memory, so a budget in bytes is converted with the probed card:

    fraction = budget bytes / card total bytes, rounded down to 3 decimals (never above the budget)

- vLLM, `--gpu-memory-utilization`: "the fraction of GPU memory to be used for the model executor ... a
  per-instance limit" (docs.vllm.ai, engine arguments): weights, activations and KV cache together.
- SGLang, `--mem-fraction-static`: "the fraction of the memory used for static allocation (model weights and
  KV cache memory pool)" (docs.sglang.io, server arguments); its activations and CUDA graphs come on top, as
  our backend's CUDA context does, and show in the memory ops measures once it is healthy.

A fraction budget (0.45) is passed as it is; ours also takes a size (18GiB), so its flag is left alone, but
for `auto`, which becomes the bytes its models need (ops/service_needs.py).
"""

import math
import shlex
import shutil
import subprocess
from dataclasses import asdict, dataclass, replace

from ops.stack import Service, StackError, is_secret


@dataclass(frozen=True)
class Engine:
    name: str
    title: str
    memory_flag: str
    fraction_only: bool  # the flag takes a fraction of the card's total memory, never a size
    sleep_api: str  # the sleep API it speaks when its sleep mode is on (compose's x-ops.sleep_api default)
    install: str  # what the process runner needs installed


ENGINES = {
    "scriptorium": Engine("scriptorium", "Scriptorium's engine", "--gpu-memory-utilization", False, "scriptorium",
                          "pip install -e . in this checkout (make up does it)"),
    "vllm": Engine("vllm", "vLLM", "--gpu-memory-utilization", True, "vllm",
                   "pip install vllm (Linux with an NVIDIA GPU; docs.vllm.ai/en/latest/getting_started/installation)"),
    "sglang": Engine("sglang", "SGLang", "--mem-fraction-static", True, "sglang",
                     'pip install "sglang[all]" (Linux with an NVIDIA GPU; docs.sglang.io/get_started/install)'),
}


@dataclass
class Launch:
    """What ops will run for a service: the argv of the process, or the image and command of the container."""
    runner: str
    engine: str | None
    command: list[str]  # process: the argv; docker: entrypoint + command inside the container
    image: str | None = None
    env: dict[str, str] | None = None  # what it adds to the environment (secrets shown as ***)
    missing: str | None = None  # process runner: why the command cannot run here (what to install)

    def to_dict(self) -> dict:
        return asdict(self)

    def shell(self) -> str:
        return shlex.join(self.command)


def memory_value(service: Service, total: int | None) -> str | None:
    """The value for the engine's memory flag on a card of `total` bytes; None: leave the file's value."""
    engine = ENGINES.get(service.engine or "")
    if service.gpu_memory == "auto":
        # Only ours measures a need (ops/service_needs.py), and its flag takes bytes; unmeasured, it measures itself.
        return None if service.need is None else str(service.need)
    if engine is None or not engine.fraction_only:
        return None
    if isinstance(service.gpu_memory, float) and 0 < service.gpu_memory <= 1:
        return f"{service.gpu_memory:g}"
    if not total or not service.gpu_memory:
        return None  # no card to convert against (the CPU): the file's value stands
    fraction = math.floor(service.budget(total) / total * 1000) / 1000
    if fraction <= 0:
        raise StackError(f"{service.name}: a budget of {service.gpu_memory} bytes is under 0.1% of the card; "
                         f"{engine.title} needs a larger x-ops.gpu_memory")
    return f"{min(fraction, 1.0):g}"


def _with_flag(argv, flag: str, value: str | None):
    if value is None or not isinstance(argv, list):
        return argv
    out, i = [], 0
    while i < len(argv):
        arg = str(argv[i])
        if arg == flag and i + 1 < len(argv):
            out += [arg, value]
            i += 2
            continue
        out.append(f"{flag}={value}" if arg.startswith(flag + "=") else argv[i])
        i += 1
    return out


def resolved(service: Service, total: int | None) -> Service:
    """The service with its engine's memory flag set from the budget (native command and container command)."""
    value = memory_value(service, total)
    if value is None:
        return service
    flag = ENGINES[service.engine].memory_flag
    return replace(service, native=_with_flag(service.native, flag, value),
                   command=_with_flag(service.command, flag, value))


def missing(service: Service) -> str | None:
    """For the process runner: why the engine's native command cannot run here, naming what to install."""
    engine = ENGINES.get(service.engine or "")
    if engine is None or not service.native:
        return None
    program = service.native[0]
    found = shutil.which(program)
    title = f"{service.name} runs {engine.title}"
    if found is None:
        return (f"{title} with `{program}`, which is not installed here: {engine.install}; "
                f"or run it in Docker (ops up --runner docker, image {service.image})")
    if len(service.native) > 2 and service.native[1] == "-m":
        module = service.native[2].split(".")[0]
        probe = subprocess.run([found, "-c", f"import importlib.util, sys; sys.exit(importlib.util.find_spec({module!r}) is None)"],
                               capture_output=True)
        if probe.returncode != 0:
            return (f"{title} as `{program} -m {service.native[2]}`, but {program} has no {module} module: "
                    f"{engine.install}; or run it in Docker (ops up --runner docker, image {service.image})")
    return None


def _shown(env: dict[str, str]) -> dict[str, str] | None:
    return {k: "***" if is_secret(k) and v else v for k, v in env.items()} or None


def launch(service: Service, runner: str, total: int | None) -> Launch:
    service = resolved(service, total)
    if runner == "docker":
        command = service.command if isinstance(service.command, list) else \
            shlex.split(service.command) if service.command else []
        entry = service.entrypoint if isinstance(service.entrypoint, list) else \
            shlex.split(service.entrypoint) if service.entrypoint else []
        return Launch("docker", service.engine, [str(c) for c in entry + command], service.image,
                      _shown(service.environment))
    return Launch("process", service.engine, list(service.native), None, _shown(service.native_env), missing(service))
