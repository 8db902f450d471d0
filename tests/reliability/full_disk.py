"""Run inside a private mount namespace (`unshare -m`, or `unshare -rm` without root): SCRIPTORIUM_HOME on a 1 MiB
tmpfs, three runs created, the disk filled to the last byte, then `orchestrator list` / `list --json` / `create`;
the disk freed and listed again; then the tmpfs remounted read-only and listed. Prints what each command said as
one JSON document. The namespace takes the mount away when this process ends, whatever happens in it."""

import json
import os
import subprocess
import sys
from pathlib import Path

MOUNT_FAILED = 3  # the test skips: no tmpfs can be mounted here


def cli(home: Path, *args: str) -> dict:
    env = {**os.environ, "SCRIPTORIUM_HOME": str(home)}
    done = subprocess.run([sys.executable, "-m", "orchestrator", *args], capture_output=True, text=True, env=env,
                          timeout=120)
    return {"rc": done.returncode, "stdout": done.stdout, "stderr": done.stderr}


def fill(directory: Path) -> None:
    """Write zeros until the file system has not one byte left (blocks first, then single bytes)."""
    fd = os.open(directory / "filler", os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    try:
        for size in (65536, 4096, 1):
            try:
                while os.write(fd, b"\0" * size):
                    pass
            except OSError:
                pass
    finally:
        os.close(fd)


def main(home: Path) -> dict:
    home.mkdir(parents=True, exist_ok=True)
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(home)]).returncode != 0:
        sys.exit(MOUNT_FAILED)
    out: dict = {"created": [cli(home, "create", f"marginalia {i}")["stdout"].strip() for i in range(3)]}
    fill(home)
    out["free_when_full"] = os.statvfs(home).f_bavail
    out["full"] = {"list": cli(home, "list"), "list_json": cli(home, "list", "--json"),
                   "create": cli(home, "create", "one more")}
    (home / "filler").unlink()
    out["freed"] = cli(home, "list", "--json")
    subprocess.run(["mount", "-o", "remount,ro", str(home)], check=True)
    out["read_only"] = {"list": cli(home, "list"), "create": cli(home, "create", "one more")}
    return out


if __name__ == "__main__":
    print(json.dumps(main(Path(sys.argv[1]))))
