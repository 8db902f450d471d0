"""The stack as compose.yaml describes it, plus each service's `x-ops` block.

Values are interpolated the way Compose does (${VAR}, ${VAR:-default}, ${VAR-default},
${VAR:?error}, $$), so `docker compose up` and `ops up` read the same file the same way: into the
parsed document, never into its text (ops/interpolation.py), so a value cannot add keys.
"""

import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

from common.settings import SLEEP_APIS
from common.sizes import SizeError, in_bytes, parse_memory
from ops.env_file import EnvFileError, read_env_file
from ops.interpolation import InterpolationError, substitute

_SECRET = re.compile(r"TOKEN|SECRET|PASSWORD|PASSWD|API_KEY|ACCESS_KEY|PRIVATE_KEY|CREDENTIAL", re.IGNORECASE)


class StackError(Exception):
    pass


def is_secret(name: str) -> bool:
    """Environment variables whose values ops never prints nor writes into units."""
    return bool(_SECRET.search(name))


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
    gpu_memory: int | float | str = 0  # bytes, a fraction (0, 1] of the card, or "auto" (its measured need)
    memory: str = "fixed"  # fixed (reserves its memory up front) | elastic (loads and frees models)
    health: str | None = None  # URL answering 2xx when the service is ready
    native: list[str] = field(default_factory=list)  # the command for the process runner
    native_env: dict[str, str] = field(default_factory=dict)
    prepare: list[list[str]] = field(default_factory=list)  # commands run before a start (e.g. fetching a model)
    stop_timeout: float = 30.0
    health_timeout: float = 600.0
    # How it lends its memory to an elastic service that would not fit (orchestrator/image_lease.py):
    # scriptorium | vllm (POST /sleep, /wake_up) | sglang (/release_ and /resume_memory_occupation) | none
    sleep_api: str = "none"
    engine: str | None = None  # the LLM engine it runs (ops/engines.py): scriptorium | vllm | sglang
    entrypoint: list[str] | str | None = None
    ipc: str | None = None  # compose's ipc (vLLM and SGLang want the host's shared memory: ipc: host)
    need: int | None = None  # bytes its models need on the card, as its engine reports them (ops/service_needs.py)

    @property
    def can_sleep(self) -> bool:
        return self.sleep_api != "none"

    def budget(self, total: int) -> int:
        """The GPU memory this service needs on a card of `total` bytes."""
        if self.gpu_memory == "auto":
            if self.need is None:
                raise StackError(f"{self.name}: x-ops.gpu_memory is auto, but its need was not measured")
            return self.need
        return in_bytes(self.gpu_memory, total)


def parse_size(value, where: str) -> int | float:
    """'18GiB' -> bytes; 0.4 -> a fraction of the card; 1073741824 -> bytes (common.sizes' grammar)."""
    try:
        return parse_memory(value)
    except SizeError as e:
        raise StackError(f"{where}: {e}") from None


def _gpu_memory(value, where: str) -> int | float | str:
    return "auto" if value == "auto" else parse_size(value, where)


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


_COMMANDS = ("native", "prepare")  # x-ops commands, whose {python}, {port} and {home} ops fills in


def _commands_apart(data) -> dict[tuple[str, str], object]:
    """Each service's x-ops commands, taken out of the parsed file before its variables are substituted: they are
    interpolated with their placeholders in one pass once the service is resolved (_command), so a value from the
    environment or .env that holds "{home}" stays those characters."""
    apart = {}
    services = data.get("services") if isinstance(data, dict) else None
    for name, spec in services.items() if isinstance(services, dict) else ():
        ops = spec.get("x-ops") if isinstance(spec, dict) else None
        for key in _COMMANDS if isinstance(ops, dict) else ():
            if key in ops:
                apart[name, key] = ops.pop(key)
    return apart


def _command(parts, env: dict[str, str], context: dict[str, str], path: Path, where: str) -> list[str]:
    """A command as written in x-ops, its ${VAR}s and placeholders filled in."""
    try:
        filled = substitute(_list(parts), env, where, placeholders={**context, "python": sys.executable})
    except InterpolationError as e:
        raise StackError(f"{path}: {e}") from None
    return [str(p) for p in filled]


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


def _read(path: Path, env: dict[str, str]) -> dict:
    from ruamel.yaml import YAML

    try:
        data = YAML(typ="safe").load(path.read_text())
    except Exception as e:  # the YAML parser's own errors
        raise StackError(f"{path} is not valid YAML: {e}") from None
    commands = _commands_apart(data)
    try:
        data = substitute(data, env)  # after parsing: a value is a string, never more YAML
    except InterpolationError as e:
        raise StackError(f"{path}: {e}") from None
    for (name, key), parts in commands.items():
        data["services"][name]["x-ops"][key] = parts
    if not isinstance(data, dict) or not isinstance(data.get("services"), dict):
        raise StackError(f"{path} has no services")
    return data


_REPLACED = {"command", "entrypoint", "test"}  # sequences an extending service replaces; others are merged


def _merge(base, local, key: str = ""):
    """Compose's merge for `extends`: mappings merge key by key, the local value winning; command, entrypoint and
    healthcheck.test are replaced; other sequences (ports, volumes, ...) are joined without duplicates."""
    if key == "environment":
        return {**_environment(base), **_environment(local)}
    if isinstance(base, dict) and isinstance(local, dict):
        merged = dict(base)
        for k, v in local.items():
            merged[k] = _merge(base[k], v, k) if k in base else v
        return merged
    if isinstance(base, list) and isinstance(local, list) and key not in _REPLACED:
        return base + [item for item in local if item not in base]
    return local


def _resolve(name: str, spec: dict, path: Path, data: dict, env: dict[str, str], seen: tuple = ()) -> dict:
    """A service's spec with its `extends` (a service of this file, or of `file`, relative to this one) merged in.
    Relative build contexts of a base in another file stay relative to that file, as in Compose."""
    extends = spec.get("extends")
    if not extends:
        return spec
    if isinstance(extends, str):
        extends = {"service": extends}
    base_path = (path.parent / extends["file"]).resolve() if extends.get("file") else path
    base_name = str(extends.get("service") or name)
    if (base_path, base_name) in seen:
        raise StackError(f"{path}: services.{name} extends itself through {base_path}:{base_name}")
    if not base_path.is_file():
        choices = sorted(p.stem for p in base_path.parent.glob("*.yaml")) if base_path.parent.is_dir() else []
        raise StackError(f"{path}: services.{name} extends {base_path}, which does not exist"
                         + (f"; choose one of {', '.join(choices)} (e.g. SCRIPTORIUM_ENGINE)" if choices else ""))
    base_data = data if base_path == path else _read(base_path, env)
    base = (base_data["services"].get(base_name))
    if not isinstance(base, dict):
        raise StackError(f"{path}: services.{name} extends {base_name}, which {base_path} does not define")
    base = _resolve(base_name, base, base_path, base_data, env, (*seen, (base_path, base_name)))
    if base_path != path and isinstance(base.get("build"), (str, dict)):
        build = base["build"] if isinstance(base["build"], dict) else {"context": base["build"]}
        base = {**base, "build": str((base_path.parent / build.get("context", ".")).resolve())}
    return _merge(base, {k: v for k, v in spec.items() if k != "extends"})


def load(path: Path | str | None = None, env: dict[str, str] | None = None) -> Stack:
    from ops.engines import ENGINES

    path = Path(path or os.environ.get("SCRIPTORIUM_COMPOSE") or _default_compose())
    if not path.is_file():
        raise StackError(f"no compose file at {path}; pass --file or set SCRIPTORIUM_COMPOSE")
    env = dict(os.environ if env is None else env)
    env_file = path.parent / ".env"
    if env_file.is_file():  # like Compose: the project's .env fills variables the environment leaves unset
        try:
            for key, value in read_env_file(env_file, env).items():
                env.setdefault(key, value)
        except EnvFileError as e:
            raise StackError(str(e)) from None
    data = _read(path, env)
    services = {}
    for name, spec in data["services"].items():
        spec = _resolve(name, spec or {}, path, data, env)
        ops = spec.get("x-ops") or {}
        where = f"{path}: services.{name}.x-ops"
        depends = spec.get("depends_on") or []
        depends = list(depends) if isinstance(depends, (list, dict)) else [depends]
        devices = (((spec.get("deploy") or {}).get("resources") or {}).get("reservations") or {}).get("devices") or []
        context = {"port": str(ops.get("port", "")), "home": env.get("SCRIPTORIUM_HOME", "")}
        memory = ops.get("memory", "fixed")
        if memory not in ("fixed", "elastic"):
            raise StackError(f"{where}.memory must be fixed or elastic, got {memory!r}")
        engine = ops.get("engine")
        if engine is not None and engine not in ENGINES:
            raise StackError(f"{where}.engine must be one of {', '.join(ENGINES)}, got {engine!r}")
        default_sleep = ENGINES[engine].sleep_api if engine else "scriptorium" if ops.get("can_sleep") else "none"
        sleep_api = str(ops.get("sleep_api") or default_sleep)
        sleep_api = default_sleep if sleep_api == "auto" else sleep_api  # SCRIPTORIUM_LLM_SLEEP_API=auto
        if sleep_api not in SLEEP_APIS:
            raise StackError(f"{where}.sleep_api must be one of {', '.join(SLEEP_APIS)}, got {sleep_api!r}")
        services[name] = Service(
            name=name, image=spec.get("image"), depends_on=[str(d) for d in depends],
            profiles=[str(p) for p in _list(spec.get("profiles"))], ports=[str(p) for p in _list(spec.get("ports"))],
            environment=_environment(spec.get("environment")), volumes=[str(v) for v in _list(spec.get("volumes"))],
            command=spec.get("command"), healthcheck=spec.get("healthcheck"),
            gpu=any("gpu" in str(d.get("capabilities", "")) for d in devices if isinstance(d, dict)),
            build=spec.get("build"), gpu_memory=_gpu_memory(ops.get("gpu_memory", 0), f"{where}.gpu_memory"),
            memory=memory, health=ops.get("health"), native_env=_environment(ops.get("env")),
            native=_command(ops.get("native"), env, context, path, f"services.{name}.x-ops.native"),
            prepare=[_command(c, env, context, path, f"services.{name}.x-ops.prepare[{i}]")
                     for i, c in enumerate(_list(ops.get("prepare")))],
            stop_timeout=float(ops.get("stop_timeout", spec.get("stop_grace_period_s", 30))),
            health_timeout=float(ops.get("health_timeout", 600)),
            sleep_api=sleep_api, engine=engine, entrypoint=spec.get("entrypoint"), ipc=spec.get("ipc"),
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
