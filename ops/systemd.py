"""systemd units for the stack: one per service in the memory-safe order, plus health and backup timers.

Each unit starts only after the previous one in plan order is healthy: its ExecStartPost waits on
the service's health URL, and systemd holds the next unit (After=) until ExecStartPost returns.

Unit files are world-readable, so no secret goes into one: the MCP token, any variable named like a
secret (..._TOKEN, ..._SECRET, ..._PASSWORD, ..._API_KEY) and the alert webhook URL are written to
$SCRIPTORIUM_HOME/state/systemd.env (mode 0600), which the units load with EnvironmentFile=.
"""

import os
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from common.files import atomic_write_text
from ops import unit_syntax
from ops.plan import order
from ops.runners.docker import LABEL, PROJECT_LABEL, SERVICE_LABEL, ports_of, volumes_of
from ops.stack import Service, Stack, StackError, is_secret

PREFIX = "scriptorium-"
PASSED_ENV = ("SCRIPTORIUM_HOME", "SCRIPTORIUM_CONFIG", "SCRIPTORIUM_LLM_URL", "SCRIPTORIUM_COMFYUI_URL",
              "SCRIPTORIUM_MCP_TOKEN", "SCRIPTORIUM_MODEL", "SCRIPTORIUM_BACKEND_PORT", "SCRIPTORIUM_MCP_PORT",
              "SCRIPTORIUM_COMFYUI_PORT", "COMFYUI_DIR", "COMFYUI_PYTHON")
WEBHOOK_ENV = "SCRIPTORIUM_ALERT_WEBHOOK"  # `ops health` reads its --webhook from here by default
@dataclass
class Units:
    files: dict[str, str]  # unit file name -> text
    env_file: Path  # where the secrets go (mode 0600); referenced by the units only when there are any
    secrets: dict[str, str] = field(default_factory=dict)


def default_env_file() -> Path:
    from ops.lifecycle import home

    return home() / "state" / "systemd.env"


def command_line(args: list[str]) -> str:
    args = list(args)
    if args and not os.path.isabs(args[0]):  # systemd wants an absolute path for the program
        found = shutil.which(args[0])
        if found is None:
            raise StackError(f"{args[0]} is not on PATH; give the full path in compose.yaml")
        args[0] = found
    return unit_syntax.exec_line(args)


def _ops(stack: Stack, *args: str) -> str:
    return command_line([sys.executable, "-m", "ops", "--file", str(stack.path), *args])


def _docker_run(service: Service, stack: Stack, gpus: bool, secrets: dict[str, str]) -> list[str]:
    name = f"{stack.project}-{service.name}"
    args = ["docker", "run", "--rm", "--name", name, "--label", f"{LABEL}=1", "--label",
            f"{SERVICE_LABEL}={service.name}", "--label", f"{PROJECT_LABEL}={stack.project}",
            "--network", f"{stack.project}_default", "--network-alias", service.name]
    for container, host in ports_of(service).items():
        port = container.split("/")[0]
        if isinstance(host, tuple):
            args += ["-p", f"{host[0]}:{host[1]}:{port}"]
        elif host:
            args += ["-p", f"{host}:{port}"]
    for key, value in service.environment.items():
        if is_secret(key) and value:  # `-e NAME` alone: docker takes the value from its environment file
            secrets[key] = value
            args += ["-e", key]
        else:
            args += ["-e", f"{key}={value}"]
    for source, spec in volumes_of(service, stack.path.parent).items():
        args += ["-v", f"{source}:{spec['bind']}:{spec['mode']}"]
    if gpus and service.gpu:
        args += ["--gpus", "all"]
    if service.ipc:
        args += ["--ipc", service.ipc]
    entry = service.entrypoint if isinstance(service.entrypoint, list) else \
        shlex.split(service.entrypoint) if service.entrypoint else []
    if entry:  # docker run takes the program as --entrypoint and its own arguments after the image
        args += ["--entrypoint", str(entry[0])]
    command = service.command
    args.append(service.image or "")
    args += [str(c) for c in entry[1:]]
    if isinstance(command, str):
        args += ["sh", "-c", command] if not entry else shlex.split(command)
    elif command:
        args += [str(c) for c in command]
    return args


def _environment(values: dict[str, str], secrets: dict[str, str]) -> str:
    """Environment= lines for what may be shown; secrets are set aside for the environment file."""
    lines = []
    for key, value in values.items():
        if is_secret(key):
            if value:
                secrets[key] = value
        else:
            lines.append(f"Environment={unit_syntax.environment(key, value)}\n")
    return "".join(lines)


def units(stack: Stack, services: list[Service], runner: str, user: bool, gpus: bool = False,
          alert: str | None = None, webhook: str | None = None, env_file: Path | None = None) -> Units:
    """The unit files, and the secrets that go to env_file (default $SCRIPTORIUM_HOME/state/systemd.env)."""
    result = Units({}, env_file or default_env_file())
    secrets = result.secrets
    ordered = order(services)
    env = _environment({k: os.environ[k] for k in PASSED_ENV if os.environ.get(k)}, secrets)
    target = "default.target" if user else "multi-user.target"
    source = unit_syntax.text(stack.path)
    files: dict[str, str] = {}
    bodies: dict[str, tuple[str, str]] = {}  # unit -> (text before the environment, text after)
    previous: list[str] = []
    for service in ordered:
        unit = f"{PREFIX}{service.name}.service"
        requires = " ".join(f"{PREFIX}{d}.service" for d in service.depends_on if d in {s.name for s in ordered})
        after = " ".join(["network-online.target"] + previous)
        if runner == "process":
            if not service.native:
                raise StackError(f"{service.name} has no x-ops.native command; use --runner docker")
            start = command_line(service.native)
            stop = "ExecStop=/bin/kill -s TERM $MAINPID\n"
            pre = ""
            service_env = _environment(service.native_env, secrets)
        elif runner == "docker":
            name = f"{stack.project}-{service.name}"
            docker = shutil.which("docker") or "/usr/bin/docker"
            start = command_line([docker, *_docker_run(service, stack, gpus, secrets)[1:]])
            pre = f"ExecStartPre=-{command_line([docker, 'rm', '-f', name])}\n"
            stop = f"ExecStop={command_line([docker, 'stop', '-t', str(int(service.stop_timeout)), name])}\n"
            service_env = ""
        else:
            raise StackError(f"unknown runner {runner!r}; use process or docker")
        prepare = "".join(f"ExecStartPre={command_line(c)}\n" for c in service.prepare) if runner == "process" else ""
        wait = f"ExecStartPost={_ops(stack, 'health', '--wait', service.name, '--timeout', str(int(service.health_timeout)))}\n"
        description = unit_syntax.text(f"Scriptorium {service.name} ({service.memory} GPU memory)")
        bodies[unit] = (
            f"# Generated by `ops systemd` from {source}; regenerate rather than edit.\n"
            f"[Unit]\nDescription={description}\n"
            f"Wants=network-online.target\nAfter={after}\n"
            + (f"Requires={requires}\n" if requires else "")
            + "StartLimitIntervalSec=600\nStartLimitBurst=5\n\n"
            f"[Service]\nType=exec\nWorkingDirectory={unit_syntax.path(stack.path.parent)}\n{env}{service_env}",
            f"{pre}{prepare}ExecStart={start}\n{wait}{stop}"
            f"TimeoutStartSec={int(service.health_timeout) + 60}\nTimeoutStopSec={int(service.stop_timeout) + 5}\n"
            "Restart=on-failure\nRestartSec=5\n\n"
            f"[Install]\nWantedBy={target}\n"
        )
        previous.append(unit)
    health_args = ["health", "--all", *(["--alert", alert] if alert else [])]
    if webhook:
        secrets[WEBHOOK_ENV] = webhook  # a webhook URL is often its own credential
    bodies[f"{PREFIX}health.service"] = (
        f"[Unit]\nDescription=Scriptorium health check (alerts on failure)\n\n[Service]\nType=oneshot\n{env}",
        f"ExecStart={_ops(stack, *health_args)}\n")
    bodies[f"{PREFIX}backup.service"] = (
        f"[Unit]\nDescription=Scriptorium daily backup\n\n[Service]\nType=oneshot\n{env}",
        f"ExecStart={_ops(stack, 'backup', 'create')}\n"
        f"ExecStartPost={_ops(stack, 'backup', 'prune', '--keep-last', '3', '--keep-daily', '7', '--keep-weekly', '4')}\n")
    # Every unit loads the same file, so a secret set aside by one service reaches the health check too.
    env_file_line = f"EnvironmentFile={unit_syntax.path(result.env_file)}\n" if secrets else ""
    for unit, (head, tail) in bodies.items():
        files[unit] = head + env_file_line + tail
        if unit.endswith(("health.service", "backup.service")):
            files[unit.replace(".service", ".timer")] = _TIMERS[unit.removeprefix(PREFIX)]
    result.files = files
    return result


_TIMERS = {
    "health.service": "[Unit]\nDescription=Scriptorium health check every 5 minutes\n\n"
                      "[Timer]\nOnBootSec=5min\nOnUnitActiveSec=5min\n\n[Install]\nWantedBy=timers.target\n",
    "backup.service": "[Unit]\nDescription=Scriptorium daily backup\n\n[Timer]\nOnCalendar=daily\nPersistent=true\n"
                      "RandomizedDelaySec=15min\n\n[Install]\nWantedBy=timers.target\n",
}


def write_secrets(generated: Units) -> Path | None:
    """The environment file the units load, readable by its owner only (set before a byte is written)."""
    if not generated.secrets:
        return None
    text = "# Secrets for Scriptorium's systemd units, written by `ops systemd`; mode 0600.\n" + "".join(
        unit_syntax.env_file_line(k, v) for k, v in sorted(generated.secrets.items()))
    atomic_write_text(generated.env_file, text, mode=0o600)
    return generated.env_file


def write(files: dict[str, str], directory: Path) -> list[Path]:
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, text in files.items():
        path = directory / name
        atomic_write_text(path, text, mode=0o644)
        paths.append(path)
    return paths


def unit_dir(user: bool) -> Path:
    override = os.environ.get("SCRIPTORIUM_SYSTEMD_DIR")
    if override:
        return Path(override)
    if user:
        return Path(os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config") / "systemd" / "user"
    return Path("/etc/systemd/system")


def install(files: dict[str, str], user: bool) -> tuple[list[Path], list[str]]:
    """Write the units, reload systemd and enable them; returns (files written, notes for the person)."""
    directory = unit_dir(user)
    paths = write(files, directory)
    notes = []
    systemctl = shutil.which("systemctl")
    scope = ["--user"] if user else []
    services = [n for n in files if n.endswith(".service") and not n.endswith(("health.service", "backup.service"))]
    timers = [n for n in files if n.endswith(".timer")]
    commands = [["systemctl", *scope, "daemon-reload"], ["systemctl", *scope, "enable", *services, *timers]]
    if systemctl is None or os.environ.get("SCRIPTORIUM_SYSTEMD_DIR"):
        notes.append("systemd was not asked to reload; run: " + " && ".join(" ".join(c) for c in commands))
    else:
        for command in commands:
            done = subprocess.run(command, capture_output=True, text=True)
            if done.returncode != 0:
                raise StackError(f"{' '.join(command)} failed: {done.stderr.strip()}")
        notes.append(f"enabled; start now with: systemctl {' '.join(scope)} start {' '.join(services)}".replace("  ", " "))
    if user:
        notes.append("user units stop when you log out unless lingering is on: loginctl enable-linger $USER")
    return paths, notes
