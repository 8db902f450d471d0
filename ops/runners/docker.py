"""Services as Docker containers through the docker SDK. Only containers carrying ops' labels are touched."""

import re
import time
from pathlib import Path

from ops.service_records import Record, State, now
from ops.stack import Service, StackError

LABEL = "org.scriptorium.ops"
SERVICE_LABEL = "org.scriptorium.service"
PROJECT_LABEL = "org.scriptorium.project"


def _duration_ns(value) -> int:
    if value is None:
        return 0
    if isinstance(value, (int, float)):
        return int(value * 1e9)
    total = 0.0
    for number, unit in re.findall(r"([0-9.]+)(ms|us|s|m|h)", str(value)):
        total += float(number) * {"us": 1e-6, "ms": 1e-3, "s": 1, "m": 60, "h": 3600}[unit]
    return int(total * 1e9)


def ports_of(service: Service) -> dict:
    ports = {}
    for spec in service.ports:
        parts = spec.split(":")
        container = parts[-1] if "/" in parts[-1] else f"{parts[-1]}/tcp"
        if len(parts) == 3:
            ports[container] = (parts[0], int(parts[1]))
        elif len(parts) == 2:
            ports[container] = int(parts[0])
        else:
            ports[container] = None
    return ports


def volumes_of(service: Service, base: Path) -> dict:
    volumes = {}
    for spec in service.volumes:
        source, _, rest = spec.partition(":")
        target, _, mode = rest.partition(":")
        if source.startswith((".", "/", "~")):
            source = str((base / source).resolve()) if source.startswith(".") else str(Path(source).expanduser())
        volumes[source] = {"bind": target, "mode": mode or "rw"}
    return volumes


def healthcheck_of(service: Service) -> dict | None:
    h = service.healthcheck
    if not h or h.get("disable"):
        return None
    test = h.get("test")
    if isinstance(test, str):
        test = ["CMD-SHELL", test]
    return {"test": test, "interval": _duration_ns(h.get("interval", "30s")),
            "timeout": _duration_ns(h.get("timeout", "30s")), "retries": int(h.get("retries", 3)),
            "start_period": _duration_ns(h.get("start_period", "0s"))}


class DockerRunner:
    name = "docker"

    def __init__(self, state: State, project: str, base: Path, gpus: bool):
        import docker

        try:
            self.client = docker.from_env()
            self.client.ping()
        except Exception as e:  # the SDK raises several kinds when no engine answers
            raise StackError(f"cannot reach the Docker engine ({e}); start dockerd, or use --runner process") from None
        self.docker = docker
        self.state = state
        self.project = project
        self.base = base
        self.gpus = gpus

    def _labels(self, service: str) -> dict:
        return {LABEL: "1", SERVICE_LABEL: service, PROJECT_LABEL: self.project}

    def _image(self, service: Service) -> str:
        if not service.image:
            raise StackError(f"{service.name} names no image")
        try:
            self.client.images.get(service.image)
        except self.docker.errors.ImageNotFound:
            if not service.build:
                raise StackError(f"image {service.image} for {service.name} is not here and no registry is used; "
                                 "build or load it first (docker compose build)") from None
            context = service.build if isinstance(service.build, str) else service.build.get("context", ".")
            self.client.images.build(path=str((self.base / context).resolve()), tag=service.image,
                                     labels={LABEL: "1"})
        return service.image

    def _network(self) -> str:
        name = f"{self.project}_default"
        if not self.client.networks.list(names=[name]):
            self.client.networks.create(name, labels={LABEL: "1", PROJECT_LABEL: self.project})
        return name

    def start(self, service: Service) -> Record:
        image = self._image(service)
        name = f"{self.project}-{service.name}"
        for old in self.client.containers.list(all=True, filters={"name": f"^{name}$"}):
            if old.labels.get(LABEL) != "1":
                raise StackError(f"a container named {name} exists that ops did not create; rename or remove it")
            old.remove(force=True)
        kwargs = dict(name=name, detach=True, labels=self._labels(service.name), ports=ports_of(service),
                      environment=service.environment, volumes=volumes_of(service, self.base),
                      network=self._network(), healthcheck=healthcheck_of(service),
                      stop_signal="SIGTERM")
        if service.entrypoint:
            kwargs["entrypoint"] = service.entrypoint
        if service.ipc:
            kwargs["ipc_mode"] = service.ipc
        if self.gpus and service.gpu:
            kwargs["device_requests"] = [self.docker.types.DeviceRequest(count=-1, capabilities=[["gpu"]])]
        container = self.client.containers.run(image, service.command, **kwargs)
        container.reload()
        network = container.attrs["NetworkSettings"]["Networks"].get(kwargs["network"])
        if network is not None and service.name not in (network.get("Aliases") or []):
            # Compose reaches a service by its name: give the container that alias on the network.
            self.client.networks.get(kwargs["network"]).disconnect(container)
            self.client.networks.get(kwargs["network"]).connect(container, aliases=[service.name])
        record = Record(service=service.name, runner=self.name, container=container.id, health=service.health,
                        started=now())
        self.state.put(record)
        return record

    def _container(self, record: Record):
        try:
            container = self.client.containers.get(record.container)
        except self.docker.errors.NotFound:
            return None
        container.reload()  # attrs (state, health) are a snapshot until reloaded
        return container

    def alive(self, record: Record) -> bool:
        container = self._container(record)
        return container is not None and container.status in ("running", "created", "restarting")

    def container_health(self, record: Record) -> str | None:
        container = self._container(record)
        if container is None:
            return None
        return ((container.attrs.get("State") or {}).get("Health") or {}).get("Status")

    def stop(self, record: Record, timeout: float) -> None:
        container = self._container(record)
        if container is not None and container.labels.get(LABEL) == "1":
            container.stop(timeout=int(timeout))
            container.remove()
        self.state.remove(record.service)

    def stop_labelled(self, services: list[str], timeout: float) -> list[str]:
        """Stop this project's labelled containers for these services, whether or not state knows them."""
        stopped = []
        for container in self.client.containers.list(all=True, filters={"label": [f"{LABEL}=1",
                                                                                 f"{PROJECT_LABEL}={self.project}"]}):
            if container.labels.get(SERVICE_LABEL) in services:
                container.stop(timeout=int(timeout))
                container.remove()
                stopped.append(container.labels[SERVICE_LABEL])
        return stopped

    def log_tail(self, record: Record, lines: int = 30) -> str:
        container = self._container(record)
        return container.logs(tail=lines).decode(errors="replace") if container is not None else ""

    def follow(self, record: Record):
        container = self._container(record)
        if container is None:
            return
        for chunk in container.logs(stream=True, follow=True, tail=0):
            yield chunk.decode(errors="replace")
        time.sleep(0)
