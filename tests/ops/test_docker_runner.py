"""The Docker runner against a real engine, with an image built here (no registry is reachable)."""

import json
import shutil
import subprocess
import tarfile
import time
from pathlib import Path

import pytest

from tests.backend.server_process import free_port
from tests.ops.conftest import run_ops

IMAGE = "scriptorium-test-busybox:latest"


def docker_ok() -> bool:
    return shutil.which("docker") is not None and subprocess.run(["docker", "info"], capture_output=True).returncode == 0


pytestmark = pytest.mark.skipif(not docker_ok(), reason="no Docker engine (.ci/run installs and starts one)")


@pytest.fixture(scope="module")
def image(tmp_path_factory):
    """A tiny image from a busybox-static root file system, made with `docker import`."""
    busybox = shutil.which("busybox")
    assert busybox, "busybox-static is needed (.ci/run installs it)"
    root = tmp_path_factory.mktemp("rootfs")
    archive = root / "rootfs.tar"
    health = root / "health"
    health.write_text("ok\n")
    with tarfile.open(archive, "w") as tar:
        tar.add(busybox, arcname="bin/busybox")
        tar.add(health, arcname="www/health")
    subprocess.run(["docker", "import", str(archive), IMAGE], check=True, capture_output=True)
    return IMAGE


def compose(tmp_path: Path, project: str, **services: dict) -> dict[str, str]:
    """tmp_path/compose.yaml naming the project's services (written as JSON, which YAML reads), and the
    environment that points ops at it."""
    path = tmp_path / "compose.yaml"
    path.write_text(json.dumps({"name": project, "services": services}, indent=2))
    return {"SCRIPTORIUM_COMPOSE": str(path)}


def httpd(image: str, port: int, ops: dict, **more) -> dict:
    """A service of the image running busybox's httpd on its /www, published on 127.0.0.1:port, with more of
    compose's keys and ops (its x-ops)."""
    return {
        "image": image,
        "command": ["/bin/busybox", "httpd", "-f", "-p", "8080", "-h", "/www"],
        "ports": [f"127.0.0.1:{port}:8080"],
        **more,
        "x-ops": ops,
    }


def test_up_in_order_with_labels_and_down_touches_only_ours(tmp_path, image):
    port_a, port_b = free_port(), free_port()
    health = ["CMD", "/bin/busybox", "wget", "-q", "-O", "-", "http://127.0.0.1:8080/health"]
    env = compose(
        tmp_path,
        "opstest",
        painter=httpd(
            image,
            port_b,
            {"memory": "elastic", "stop_timeout": 2},
            depends_on={"scribe": {"condition": "service_healthy"}},
            healthcheck={"test": health, "interval": "1s", "timeout": "2s", "retries": 20},
        ),
        scribe=httpd(
            image,
            port_a,
            {"memory": "fixed", "health": f"http://127.0.0.1:{port_a}/health", "stop_timeout": 2},
            environment={"ROLE": "scribe"},
        ),
    )
    bystander = subprocess.run(["docker", "run", "-d", "--name", f"bystander-{port_a}", image, "/bin/busybox",
                                "sleep", "300"], capture_output=True, text=True, check=True).stdout.strip()
    try:
        up = run_ops(tmp_path / "home", "up", "--runner", "docker", env=env)
        assert up.returncode == 0, up.stderr
        order = [line.split()[0] for line in up.stderr.splitlines() if line.split()[1:2] == ["started"]]
        assert order == ["scribe", "painter"]

        inspect = json.loads(subprocess.run(["docker", "inspect", "opstest-scribe", "opstest-painter"],
                                            capture_output=True, text=True, check=True).stdout)
        for container in inspect:
            labels = container["Config"]["Labels"]
            assert labels["org.scriptorium.ops"] == "1" and labels["org.scriptorium.project"] == "opstest"
        scribe, painter = inspect
        assert "ROLE=scribe" in scribe["Config"]["Env"]
        assert painter["State"]["Health"]["Status"] == "healthy"  # the health ops waited for, via reload()
        started = {c["Name"]: c["State"]["StartedAt"] for c in inspect}
        assert started["/opstest-scribe"] < started["/opstest-painter"]

        status = json.loads(run_ops(tmp_path / "home", "status", "--json", env=env).stdout)
        assert {s["service"]: s["state"] for s in status["services"]} == {"painter": "healthy", "scribe": "healthy"}
        assert run_ops(tmp_path / "home", "health", env=env).returncode == 0

        down = run_ops(tmp_path / "home", "down", env=env)
        assert down.returncode == 0 and down.stdout.strip() == "stopped painter, scribe"
        left = subprocess.run(["docker", "ps", "-a", "--format", "{{.Names}}"], capture_output=True, text=True).stdout
        assert "opstest-" not in left and f"bystander-{port_a}" in left
        running = subprocess.run(["docker", "inspect", "-f", "{{.State.Running}}", bystander], capture_output=True,
                                 text=True).stdout.strip()
        assert running == "true"
    finally:
        subprocess.run(["docker", "rm", "-f", bystander, "opstest-scribe", "opstest-painter"], capture_output=True)
        time.sleep(0)


def test_a_missing_image_says_how_to_get_it(tmp_path):
    (tmp_path / "compose.yaml").write_text("services:\n  ghost:\n    image: no-such-image:1\n")
    up = run_ops(tmp_path / "home", "up", "--runner", "docker", env={"SCRIPTORIUM_COMPOSE": str(tmp_path /
                                                                                           "compose.yaml")})
    assert up.returncode == 1 and "image no-such-image:1 for ghost is not here" in up.stderr


def test_backup_commits_and_saves_labelled_containers(tmp_path, image):
    port = free_port()
    ops = {"health": f"http://127.0.0.1:{port}/health", "stop_timeout": 2}
    env = compose(tmp_path, "opsbackup", keeper=httpd(image, port, ops))
    try:
        assert run_ops(tmp_path / "home", "up", "--runner", "docker", env=env).returncode == 0
        made = run_ops(tmp_path / "home", "backup", "--json", env=env)
        assert made.returncode == 0, made.stderr
        saved = tmp_path / "home" / "backups" / json.loads(made.stdout)["id"] / "docker" / "keeper.tar"
        with tarfile.open(saved) as tar:
            names = tar.getnames()
        assert "manifest.json" in names  # a `docker save` archive, loadable with `docker load`
        assert run_ops(tmp_path / "home", "backup", "verify", env=env).returncode == 0
        leftovers = subprocess.run(["docker", "images", "-q", "scriptorium-backup-keeper"], capture_output=True,
                                   text=True).stdout.strip()
        assert leftovers == ""  # the committed image was only a step on the way to the archive
    finally:
        run_ops(tmp_path / "home", "down", env=env)
        subprocess.run(["docker", "rm", "-f", "opsbackup-keeper"], capture_output=True)
