"""Services as plain processes: their own process group, a pid file, a log, alive after ops exits."""

import os
import signal
import subprocess
import time
from collections import deque

from ops.service_records import Record, State, identify, now, same_process
from ops.stack import Service, StackError


class ProcessRunner:
    name = "process"

    def __init__(self, state: State):
        self.state = state

    def start(self, service: Service) -> Record:
        if not service.native:
            raise StackError(f"{service.name} has no x-ops.native command, so it cannot run as a process; "
                             "use --runner docker")
        self.state.logs.mkdir(parents=True, exist_ok=True)
        log_path = self.state.logs / f"{service.name}.log"
        env = {**os.environ, **service.native_env}
        with open(log_path, "ab") as log:
            log.write(f"\n--- ops started {service.name} at {time.strftime('%Y-%m-%d %H:%M:%S')}: "
                      f"{' '.join(service.native)}\n".encode())
            log.flush()
            try:
                proc = subprocess.Popen(service.native, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                        env=env, start_new_session=True)
            except OSError as e:
                raise StackError(f"cannot start {service.name} ({' '.join(service.native)}): {e}") from None
        record = identify(Record(service=service.name, runner=self.name, pid=proc.pid, command=service.native,
                                 health=service.health, log=str(log_path), started=now()))
        self.state.put(record)
        return record

    def alive(self, record: Record) -> bool:
        return same_process(record)

    def stop(self, record: Record, timeout: float) -> None:
        """Stop the recorded process and forget it. A pid that now belongs to another process (ours exited
        and the pid was reused) is gone, never signalled; every signal is sent only after that check."""
        if same_process(record):
            _signal_group(record.pid, signal.SIGTERM)
            deadline = time.monotonic() + timeout
            while same_process(record) and time.monotonic() < deadline:
                time.sleep(0.1)
            if same_process(record):
                _signal_group(record.pid, signal.SIGKILL)
                while same_process(record) and time.monotonic() < deadline + 5:
                    time.sleep(0.05)
        self.state.remove(record.service)

    def log_tail(self, record: Record, lines: int = 30) -> str:
        try:
            with open(record.log, errors="replace") as f:
                return "".join(deque(f, maxlen=lines))
        except (OSError, TypeError):
            return ""

    def follow(self, record: Record):
        with open(record.log, errors="replace") as f:
            f.seek(0, os.SEEK_END)
            while True:
                line = f.readline()
                if line:
                    yield line
                else:
                    time.sleep(0.3)


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)  # the service was started as its own session: its children go too
    except ProcessLookupError:
        pass
    except PermissionError:
        os.kill(pid, sig)
