"""The first second of stdio: `python -m mcp_server` answers a client's `initialize`, `tools/list` and
`prompts/list` with what the SDK server answered at an earlier start, while the SDK (about 0.7 s of imports)
loads in a thread; then every message goes through to the SDK server.

Agents start their MCP servers beside their first model request (Codex sends it about a second after it spawns
us) and leave out tools listed later than that. The remembered answers are checked at every start: once loaded,
the SDK server is told the client's `initialize` and asked the same lists (ids starting with REPLAY); its answers
are kept from the client, and where they differ from the remembered ones they replace them.

A client whose first message is not `initialize` (the stateless protocol era), or one asking for a protocol
version not seen before, waits for the SDK server and gets its answers.
"""

import hashlib
import json
import os
import subprocess
import sys
import threading
from collections.abc import Callable
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

try:
    import fcntl
except ImportError:  # Windows: starts at once may keep one version's answers, not both
    fcntl = None

REPLAY = "scriptorium-front:"
END = b'"scriptorium-front:end"\n'  # written after the SDK's last line: a copy of the pipe may outlive it
REMEMBERED = {"tools/list": "tools", "prompts/list": "prompts"}  # method -> the capability that offers it


def answers_path(home: Path, toolsets: tuple[str, ...], budget: float | None) -> Path:
    """Where this code's answers are kept, for this SDK and these settings."""
    digest = hashlib.sha256()
    for path in sorted(Path(__file__).parent.glob("*.py")):
        digest.update(path.read_bytes())
    try:
        sdk = version("mcp")
    except PackageNotFoundError:
        sdk = "unknown"
    digest.update(json.dumps([list(toolsets), budget, sdk, sys.version]).encode())
    return home / "cache" / "mcp" / f"answers-{digest.hexdigest()[:16]}.json"


def _read(path: Path) -> dict:
    try:
        answers = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return answers if isinstance(answers, dict) else {}


def _line(message: dict) -> bytes:
    return json.dumps(message, separators=(",", ":")).encode() + b"\n"


def _send(fd: int, data: bytes) -> None:
    while data:
        data = data[os.write(fd, data):]


class Front:
    """Owns the real stdin and stdout; `run_sdk` serves MCP on fds 0 and 1 (the SDK's stdio transport), which
    become pipes to this front once the SDK server is loaded."""

    def __init__(self, answers: Path, load: Callable[[], Callable[[], None]]):
        self.answers_file, self.answers, self.load = answers, _read(answers), load
        self.stdin = os.fdopen(os.dup(0), "rb")
        self.stdout = os.dup(1)
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)  # stray reads see EOF, stray prints go to stderr
        os.dup2(2, 1)
        # Held while a line is handled and during the hand-over. The wire has one writer at a time: this thread
        # before the hand-over, the thread reading the SDK's output after it.
        self.lock = threading.Lock()
        self.sdk_in: int | None = None  # our end of the SDK's stdin once handed over
        self.queued: list[bytes] = []  # lines the SDK server will get, in order
        self.init: dict | None = None  # the client's initialize request
        self.init_answered = False
        self.replies: dict[str, dict] = {}  # replayed method -> the SDK's result
        self.replayed = threading.Event()  # the SDK answered the replayed initialize
        self.handed_over = threading.Event()

    def serve(self) -> int:
        loader = threading.Thread(target=self._load, daemon=True)
        loader.start()
        for raw in self.stdin:
            with self.lock:
                if self.sdk_in is not None:
                    self._forward(raw)
                else:
                    self._before_hand_over(raw)
        with self.lock:  # EOF: the client is gone, but what it asked is answered
            unanswered = self.queued or (self.init is not None and not self.init_answered)
        if unanswered:
            self.handed_over.wait()
        with self.lock:
            if self.sdk_in is None:
                return 0
            os.close(self.sdk_in)
        self.sdk.join()
        os.dup2(2, 1)
        _send(self.sdk_out, END)
        self.reader.join()
        return 0

    def _before_hand_over(self, raw: bytes) -> None:
        try:
            message = json.loads(raw)
        except ValueError:
            message = None
        if not isinstance(message, dict):
            message = {}
        method = message.get("method")
        if self.init is None and not self.queued and method == "initialize":
            self.init = message
            result = self._remembered("initialize")
            if result is not None:
                self.init_answered = True
                _send(self.stdout, _line({"jsonrpc": "2.0", "id": message.get("id"), "result": result}))
            return
        if self.init is not None and method == "notifications/initialized":
            return  # the front sends the SDK its own, after the replayed initialize
        if self.init_answered and not self.queued and "id" in message:
            result = {} if method == "ping" else self._remembered(method)
            if result is not None and not (message.get("params") or {}).get("cursor"):
                _send(self.stdout, _line({"jsonrpc": "2.0", "id": message["id"], "result": result}))
                return
        self.queued.append(raw)

    def _remembered(self, method: str | None) -> dict | None:
        wanted = (self.init or {}).get("params", {}).get("protocolVersion")
        return self.answers.get(method, {}).get(wanted) if isinstance(wanted, str) else None

    def _forward(self, raw: bytes) -> None:
        if self.init is not None and b"notifications/initialized" in raw:
            try:
                if json.loads(raw).get("method") == "notifications/initialized":
                    return
            except (ValueError, AttributeError):
                pass
        _send(self.sdk_in, raw)

    def _load(self) -> None:
        try:
            run_sdk = self.load()
        except BaseException as e:  # noqa: BLE001 - the client must see the process end, with the reason
            print(f"error: the MCP server could not start: {e}", file=sys.stderr, flush=True)
            os._exit(1)
        in_read, in_write = os.pipe()
        out_read, out_write = os.pipe()
        with self.lock:
            os.dup2(in_read, 0)
            os.dup2(out_write, 1)
            os.close(in_read)
            self.sdk_out = out_write  # kept to end the reader with END
            self.reader = threading.Thread(target=self._read_sdk, args=(os.fdopen(out_read, "rb"),), daemon=True)
            self.reader.start()
            self.sdk = threading.Thread(target=self._run_sdk, args=(run_sdk,), daemon=True)
            self.sdk.start()
            self.sdk_in = in_write
            if self.init is not None:
                self._replay()
            for raw in self.queued:
                self._forward(raw)
            self.queued = []
        self.handed_over.set()

    def _run_sdk(self, run_sdk: Callable[[], None]) -> None:
        try:
            run_sdk()
        except BaseException as e:  # noqa: BLE001 - the client must see the process end, with the reason
            print(f"error: the MCP server stopped: {e}", file=sys.stderr, flush=True)
            os._exit(1)

    def _replay(self) -> None:
        """The client's initialize (answered by the SDK now, unless the front did), then the lists to check."""
        _send(self.sdk_in, _line({**self.init, "id": REPLAY + "initialize"}))
        if not self.replayed.wait(60):
            return
        _send(self.sdk_in, _line({"jsonrpc": "2.0", "method": "notifications/initialized"}))
        offered = self.replies.get("initialize", {}).get("capabilities", {})
        for method, capability in REMEMBERED.items():
            if capability in offered:
                _send(self.sdk_in, _line({"jsonrpc": "2.0", "id": REPLAY + method, "method": method}))

    def _read_sdk(self, sdk_out) -> None:
        for raw in sdk_out:
            if raw == END:
                return
            try:
                message = json.loads(raw)
            except ValueError:
                sys.stderr.write(raw.decode(errors="replace"))  # a stray print, kept off the wire
                continue
            ident = message.get("id") if isinstance(message, dict) else None
            if not (isinstance(ident, str) and ident.startswith(REPLAY)):
                _send(self.stdout, raw)
                continue
            method = ident[len(REPLAY):]
            if method == "initialize":
                if not self.init_answered:  # the client waits for this one
                    _send(self.stdout, _line({**message, "id": self.init.get("id")}))
                if "result" in message:
                    self.replies["initialize"] = message["result"]
                self.replayed.set()
            elif "result" in message and "nextCursor" not in message["result"]:
                self.replies[method] = message["result"]
            self._remember()

    def _remember(self) -> None:
        """Once the SDK answered what it was asked, its answers replace the remembered ones that differ."""
        offered = self.replies.get("initialize", {}).get("capabilities")
        if offered is None or any(c in offered and m not in self.replies for m, c in REMEMBERED.items()):
            return
        wanted = self.init.get("params", {}).get("protocolVersion")
        replies, self.replies = self.replies, {}
        if all(self.answers.get(m, {}).get(wanted) == r for m, r in replies.items()):
            return
        try:
            self.answers_file.parent.mkdir(parents=True, exist_ok=True)
            with open(self.answers_file.with_suffix(".lock"), "w") as lock:
                if fcntl:
                    fcntl.flock(lock, fcntl.LOCK_EX)  # starts at once (install primes two) each add their version
                answers = _read(self.answers_file)
                for method, result in replies.items():
                    answers.setdefault(method, {})[wanted] = result
                partial = self.answers_file.with_suffix(f".{os.getpid()}.tmp")
                partial.write_text(json.dumps(answers))
                partial.replace(self.answers_file)
        except OSError as e:
            print(f"warning: could not keep the MCP answers in {self.answers_file}: {e}", file=sys.stderr)


PRIMED_VERSIONS = ("2025-06-18", "2025-11-25")  # what today's agents ask for (Codex, Claude Code)


def prime(command: list[str], env: dict[str, str], cwd: Path, timeout: float = 60) -> list[str]:
    """Start the server as an agent's entry does, once per protocol version in PRIMED_VERSIONS, at once, so
    that the agent's first start finds the answers remembered. Returns what went wrong, for a note."""
    problems: list[str] = []
    runs = [threading.Thread(target=_prime_one, args=(command, env, cwd, wanted, timeout, problems))
            for wanted in PRIMED_VERSIONS]
    for run in runs:
        run.start()
    for run in runs:
        run.join()
    return problems


def _prime_one(command: list[str], env: dict[str, str], cwd: Path, wanted: str, timeout: float,
               problems: list[str]) -> None:
    asked = [{"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
        "protocolVersion": wanted, "capabilities": {}, "clientInfo": {"name": "scriptorium-install", "version": "1"}}},
        {"jsonrpc": "2.0", "method": "notifications/initialized"},
        *({"jsonrpc": "2.0", "id": i, "method": m} for i, m in enumerate(REMEMBERED, start=2))]
    proc = subprocess.Popen(command, env=env, cwd=cwd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    killer = threading.Timer(timeout, proc.kill)
    killer.start()
    try:
        proc.stdin.write(b"".join(_line(m) for m in asked))
        proc.stdin.flush()
        waiting = {m["id"] for m in asked if "id" in m}
        for raw in proc.stdout:  # the SDK may drop what is in flight at EOF: close stdin once all is answered
            waiting.discard(json.loads(raw).get("id"))
            if not waiting:
                break
        proc.stdin.close()
        err = proc.stderr.read().decode(errors="replace").strip().splitlines()
        if proc.wait() != 0 or waiting:
            problems.append(f"the server did not answer ({wanted}): {err[-1] if err else proc.returncode}")
    except (OSError, ValueError) as e:
        problems.append(f"the server could not be asked ({wanted}): {e}")
    finally:
        killer.cancel()
        proc.kill()
