"""What the GPUs hold right now: NVML, else nvidia-smi, else "no GPU".

Per device: total and free memory, and every process using it, ours or not. The one seam for
tests and dry runs: SCRIPTORIUM_GPU_PROBE_FILE names a JSON file of devices to report instead.
"""

import json
import os
import shutil
import subprocess
from dataclasses import asdict, dataclass, field


@dataclass
class GPUProcess:
    pid: int
    name: str
    used: int  # bytes


@dataclass
class Device:
    index: int
    name: str
    total: int  # bytes
    free: int
    processes: list[GPUProcess] = field(default_factory=list)
    temperature: int | None = None  # degrees Celsius

    def to_dict(self) -> dict:
        return asdict(self)


def probe() -> tuple[list[Device], str]:
    """(devices, source): source is nvml, nvidia-smi, file or none."""
    path = os.environ.get("SCRIPTORIUM_GPU_PROBE_FILE")
    if path:
        with open(path) as f:
            data = json.load(f)
        return [Device(d["index"], d["name"], int(d["total"]), int(d["free"]),
                       [GPUProcess(int(p["pid"]), p["name"], int(p["used"])) for p in d.get("processes", [])],
                       d.get("temperature")) for d in data], "file"
    devices = _nvml()
    if devices is not None:
        return devices, "nvml"
    devices = _nvidia_smi()
    if devices is not None:
        return devices, "nvidia-smi"
    return [], "none"


def _process_name(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return "?"


def _nvml() -> list[Device] | None:
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except Exception:  # no driver, no device: NVML raises its own error types
        return None
    try:
        devices = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            info = pynvml.nvmlDeviceGetMemoryInfo(handle)
            name = pynvml.nvmlDeviceGetName(handle)
            name = name.decode() if isinstance(name, bytes) else name
            procs = []
            for getter in (pynvml.nvmlDeviceGetComputeRunningProcesses, pynvml.nvmlDeviceGetGraphicsRunningProcesses):
                try:
                    for p in getter(handle):
                        procs.append(GPUProcess(p.pid, _process_name(p.pid), int(p.usedGpuMemory or 0)))
                except Exception:  # noqa: BLE001 some drivers refuse one of the two queries
                    pass
            try:
                temperature = int(pynvml.nvmlDeviceGetTemperature(handle, pynvml.NVML_TEMPERATURE_GPU))
            except Exception:  # noqa: BLE001 not every board reports it
                temperature = None
            devices.append(Device(i, name, int(info.total), int(info.free), procs, temperature))
        return devices
    finally:
        pynvml.nvmlShutdown()


def _nvidia_smi() -> list[Device] | None:
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        gpus = subprocess.run(["nvidia-smi", "--query-gpu=index,uuid,name,memory.total,memory.free,temperature.gpu",
                               "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=15)
        apps = subprocess.run(["nvidia-smi", "--query-compute-apps=gpu_uuid,pid,process_name,used_memory",
                               "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=15)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if gpus.returncode != 0:
        return None
    mib = 2**20
    devices, by_uuid = [], {}
    for line in gpus.stdout.strip().splitlines():
        index, uuid, name, total, free, temperature = [x.strip() for x in line.split(",")]
        device = Device(int(index), name, int(float(total) * mib), int(float(free) * mib), [],
                        int(temperature) if temperature.isdigit() else None)
        devices.append(device)
        by_uuid[uuid] = device
    for line in apps.stdout.strip().splitlines():
        parts = [x.strip() for x in line.split(",")]
        if len(parts) == 4 and parts[0] in by_uuid and parts[1].isdigit():
            used = int(float(parts[3]) * mib) if parts[3].replace(".", "").isdigit() else 0
            by_uuid[parts[0]].processes.append(GPUProcess(int(parts[1]), parts[2], used))
    return devices


def fmt(n: int | float) -> str:
    return f"{n / 2**30:.1f} GiB"
