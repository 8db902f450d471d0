"""The stack as compose.yaml describes it, plus each service's `x-ops` block.

Values are interpolated the way Compose does (${VAR}, ${VAR:-default}, ${VAR-default},
${VAR:?error}, $$), so `docker compose up` and `ops up` read the same file the same way.
"""

import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

from common.sizes import SizeError, in_bytes, parse_memory

_VAR = re.compile(r"\$(?:\$|\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?)([-?])((?:[^{}]|\{[^{}]*\})*))?\}|([A-Za-z_][A-Za-z0-9_]*))")


class StackError(Exception):
    pass


@dataclass
class Service:
    name: str
    image: str | None
    depends_on: list[str]
    profiles: list[str]
    ports: list[str]
    environment: dict[str, str]
    volumes: list[str]
    command: list[str] | str | None
    healthcheck: dict | None
    gpu: bool  # reserves GPU devices in compose (deploy.resources.reservations.devices)
    build: str | dict | None = None
    gpu_memory: int | float = 0  # bytes, or a fraction (0, 1] of the card
    memory: str = "fixed"  # fixed (reserves its memory up front) | elastic (loads and frees models)
    health: str | None = None  # URL answering 2xx when the service is ready
    native: list[str] = field(default_factory=list)  # the command for the process runner
    native_env: dict[str, str] = field(default_factory=dict)
    prepare: list[list[str]] = field(default_factory=list)  # commands run before a start (e.g. fetching a model)
    stop_timeout: float = 30.0
    health_timeout: float = 600.0
    can_sleep: bool = False  # lends its memory (POST /sleep) to an elastic service that would not fit

    def budget(self, total: int) -> int:
        """The GPU memory this service needs on a card of `total` bytes."""
        return in_bytes(self.gpu_memory, total)


def interpolate(text: str, env: dict[str, str]) -> str:
    def replace(m: re.Match) -> str:
        whole = m.group(0)
        if whole == "$$":
            return "$"
        name = m.group(1) or m.group(5)
        colon, op, arg = m.group(2), m.group(3), m.group(4)
        value = env.get(name)
        missing = value is None or (colon == ":" and value == "")
        if op == "-":
            return interpolate(arg, env) if missing else value
        if op == "?":
            if missing:
                raise StackError(f"compose.yaml needs ${{{name}}}: {arg or 'set it in the environment'}")
            return value
        return value or ""

    return _VAR.sub(replace, text)


def parse_size(value, where: str) -> int | float:
    """'18GiB' -> bytes; 0.4 -> a fraction of the card; 1073741824 -> bytes (common.sizes' grammar)."""
    try:
        return parse_memory(value)
    except SizeError as e:
        raise StackError(f"{where}: {e}") from None


def _list(value) -> list:
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple)) else [value]


def _environment(value) -> dict[str, str]:
    if isinstance(value, dict):
        return {str(k): "" if v is None else str(v) for k, v in value.items()}
    env = {}
    for item in _list(value):
        key, _, val = str(item).partition("=")
        env[key] = val
    return env


def _expand(parts, context: dict[str, str]) -> list[str]:
    return [str(p).replace("{python}", sys.executable).format_map(_Defaulting(context)) for p in parts]


class _Defaulting(dict):
    def __missing__(self, key: str) -> str:
        return "{" + key + "}"


@dataclass
class Stack:
    path: Path
    project: str
    services: dict[str, Service]

    def selected(self, names: list[str] | None, profiles: list[str]) -> list[Service]:
        """The services to act on: those named (with their dependencies), or all in the active profiles."""
        if names:
            unknown = [n for n in names if n not in self.services]
            if unknown:
                raise StackError(f"unknown service(s) {', '.join(unknown)}; the stack has {', '.join(self.services)}")
            wanted, queue = set(), list(names)
            while queue:
                name = queue.pop()
                if name not in wanted:
                    wanted.add(name)
                    queue += self.services[name].depends_on
        else:
            wanted = {n for n, s in self.services.items() if not s.profiles or set(s.profiles) & set(profiles)}
        return [s for n, s in self.services.items() if n in wanted]


def load(path: Path | str | None = None, env: dict[str, str] | None = None) -> Stack:
    from ruamel.yaml import YAML

    path = Path(path or os.environ.get("SCRIPTORIUM_COMPOSE") or _default_compose())
    if not path.is_file():
        raise StackError(f"no compose file at {path}; pass --file or set SCRIPTORIUM_COMPOSE")
    env = dict(os.environ if env is None else env)
    env_file = path.parent / ".env"
    if env_file.is_file():  # like Compose: the project's .env fills variables the environment leaves unset
        for line in env_file.read_text().splitlines():
            if "=" in line and not line.lstrip().startswith("#"):
                key, _, value = line.partition("=")
                env.setdefault(key.strip(), value.strip().strip("\"'"))
    try:
        data = YAML(typ="safe").load(interpolate(path.read_text(), env))
    except StackError:
        raise
    except Exception as e:  # the YAML parser's own errors
        raise StackError(f"{path} is not valid YAML: {e}") from None
    if not isinstance(data, dict) or not isinstance(data.get("services"), dict):
        raise StackError(f"{path} has no services")
    services = {}
    for name, spec in data["services"].items():
        spec = spec or {}
        ops = spec.get("x-ops") or {}
        where = f"{path}: services.{name}.x-ops"
        depends = spec.get("depends_on") or []
        depends = list(depends) if isinstance(depends, (list, dict)) else [depends]
        devices = (((spec.get("deploy") or {}).get("resources") or {}).get("reservations") or {}).get("devices") or []
        context = {"port": str(ops.get("port", "")), "home": env.get("SCRIPTORIUM_HOME", "")}
        memory = ops.get("memory", "fixed")
        if memory not in ("fixed", "elastic"):
            raise StackError(f"{where}.memory must be fixed or elastic, got {memory!r}")
        services[name] = Service(
            name=name, image=spec.get("image"), depends_on=[str(d) for d in depends],
            profiles=[str(p) for p in _list(spec.get("profiles"))], ports=[str(p) for p in _list(spec.get("ports"))],
            environment=_environment(spec.get("environment")), volumes=[str(v) for v in _list(spec.get("volumes"))],
            command=spec.get("command"), healthcheck=spec.get("healthcheck"),
            gpu=any("gpu" in str(d.get("capabilities", "")) for d in devices if isinstance(d, dict)),
            build=spec.get("build"), gpu_memory=parse_size(ops.get("gpu_memory", 0), f"{where}.gpu_memory"),
            memory=memory, health=ops.get("health"), native=_expand(_list(ops.get("native")), context),
            native_env=_environment(ops.get("env")), prepare=[_expand(c, context) for c in _list(ops.get("prepare"))],
            stop_timeout=float(ops.get("stop_timeout", spec.get("stop_grace_period_s", 30))),
            health_timeout=float(ops.get("health_timeout", 600)),
            can_sleep=bool(ops.get("can_sleep", False)),
        )
    for service in services.values():
        missing = [d for d in service.depends_on if d not in services]
        if missing:
            raise StackError(f"{path}: {service.name} depends on unknown service(s) {', '.join(missing)}")
    project = data.get("name") or env.get("COMPOSE_PROJECT_NAME") or path.parent.name
    return Stack(path=path, project=str(project), services=services)


def _default_compose() -> Path:
    here = Path.cwd() / "compose.yaml"
    if here.is_file():
        return here
    return Path(__file__).resolve().parent.parent / "compose.yaml"
