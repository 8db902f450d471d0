"""The first second of stdio: `python -m mcp_server` answers a client's `initialize` at once, without the SDK
(mcp_server/initialize_result.py), `tools/list` and `prompts/list` with what the SDK server answered at an
earlier start, and `resources/list` from jobs.db (job_resources.py), while the SDK (0.7 s of imports, seconds on a
loaded machine) loads in a thread; then every message goes through to the SDK server. Claude Code offers none of
a server's tools until all three lists are answered.

Agents start their MCP servers beside their first model request (Codex sends it about a second after it spawns
us) and give up on a server that has not answered `initialize` in time. The remembered lists are checked at every
start: once loaded, the SDK server is told the client's `initialize` (with the protocol version the client was
answered) and asked the same lists (ids starting with REPLAY); its answers are kept from the client, and where
they differ from the remembered ones they replace them, and the client, told a list that differs, gets
`notifications/<tools|prompts>/list_changed` (the initialize result says listChanged for both). The file is used
only when it checks out (mcp_server/answers_file.py); it keeps the SDK's initialize result beside the lists, as
the record of the protocol version they were answered for.

A client whose first message is not `initialize` (the stateless protocol era), or whose `initialize` the SDK
would refuse, waits for the SDK server and gets its answers; so do the lists of a first start.
"""

import json
import os
import sys
import threading
from collections.abc import Callable

from mcp_server import answers_file, initialize_result
from mcp_server.answers_file import AnswersFile, Untrusted

REPLAY = "scriptorium-front:"
END = b'"scriptorium-front:end"\n'  # written after the SDK's last line: a copy of the pipe may outlive it
REMEMBERED = {"tools/list": "tools", "prompts/list": "prompts"}  # method -> the capability that offers it
FIRST_WAIT = 0.2  # seconds the SDK waits for the client's first message to be answered before it loads anyway


def _advertised(result: dict) -> dict:
    """The SDK's initialize result, saying that the lists the front may answer from a file can change: when the
    SDK server's own list is not the one the client was told, the front sends the client list_changed."""
    capabilities = dict(result.get("capabilities") or {})
    for capability in REMEMBERED.values():
        if isinstance(capabilities.get(capability), dict):
            capabilities[capability] = {**capabilities[capability], "listChanged": True}
    return {**result, "capabilities": capabilities}


def _line(message: dict) -> bytes:
    return json.dumps(message, separators=(",", ":")).encode() + b"\n"


def _send(fd: int, data: bytes) -> None:
    while data:
        data = data[os.write(fd, data):]


class Front:
    """Owns the real stdin and stdout; `run_sdk` serves MCP on fds 0 and 1 (the SDK's stdio transport), which
    become pipes to this front once the SDK server is loaded."""

    def __init__(self, answers: AnswersFile, load: Callable[[], Callable[[], None]], toolsets: tuple[str, ...],
                 live: dict[str, Callable[[], dict]] | None = None):
        self.answers_file, self.load, self.toolsets = answers, load, toolsets
        self.live = live or {}  # method -> its result, computed without the SDK (resources/list: jobs.db)
        try:
            self.answers = answers_file.read(answers)
        except (Untrusted, OSError) as e:  # stderr: stdout is the protocol's
            print(f"warning: remembered MCP answers not used, the server's own replace them: {e}", file=sys.stderr,
                  flush=True)
            self.answers = {}
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
        self.version: str | None = None  # the protocol version the client was answered
        self.replies: dict[str, dict] = {}  # replayed method -> the SDK's result
        self.told: dict[str, dict] = {}  # method -> the result the client got for it from the front
        self.replayed = threading.Event()  # the SDK answered the replayed initialize
        self.handed_over = threading.Event()
        # Set once the first message is handled: the SDK's imports, which hold the GIL most of the time, start after
        # the answer to `initialize` (or FIRST_WAIT seconds after the start, for a client that says nothing).
        self.first_handled = threading.Event()

    def serve(self) -> int:
        loader = threading.Thread(target=self._load, daemon=True)
        loader.start()
        for raw in self.stdin:
            with self.lock:
                if self.sdk_in is not None:
                    self._forward(raw)
                else:
                    self._before_hand_over(raw)
            self.first_handled.set()
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
            result = initialize_result.result(message.get("params"), self.toolsets)
            if result is not None:
                self.init_answered, self.version = True, result["protocolVersion"]
                self.told["initialize"] = result
                _send(self.stdout, _line({"jsonrpc": "2.0", "id": message.get("id"), "result": result}))
            return
        if self.init is not None and method == "notifications/initialized":
            return  # the front sends the SDK its own, after the replayed initialize
        if self.init_answered and not self.queued and "id" in message:
            result = {} if method == "ping" else self._live(method) or self._remembered(method)
            params = message.get("params")
            if result is not None and not (isinstance(params, dict) and params.get("cursor")):
                self.told[method] = result
                _send(self.stdout, _line({"jsonrpc": "2.0", "id": message["id"], "result": result}))
                return
        self.queued.append(raw)

    def _live(self, method: str | None) -> dict | None:
        """A result the front computes itself; None (the SDK server answers, errors included) where it cannot."""
        offered = self.told["initialize"].get("capabilities") or {}
        if method not in self.live or method.split("/")[0] not in offered:
            return None
        try:
            return self.live[method]()
        except Exception:  # noqa: BLE001 - the SDK server gives the client this error in the protocol's words
            return None

    def _remembered(self, method: str | None) -> dict | None:
        return self.answers.get(method, {}).get(self.version) if self.version is not None else None

    def _forward(self, raw: bytes) -> None:
        if self.init is not None and b"notifications/initialized" in raw:
            try:
                if json.loads(raw).get("method") == "notifications/initialized":
                    return
            except (ValueError, AttributeError):
                pass
        _send(self.sdk_in, raw)

    def _load(self) -> None:
        self.first_handled.wait(FIRST_WAIT)
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
        init = {**self.init, "id": REPLAY + "initialize"}
        if self.version is not None:  # the SDK server speaks the version the client was told
            init["params"] = {**init["params"], "protocolVersion": self.version}
        _send(self.sdk_in, _line(init))
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
                self._replayed_initialize(message)
            elif "result" in message and "nextCursor" not in message["result"]:
                self.replies[method] = message["result"]
            self._remember()

    def _replayed_initialize(self, message: dict) -> None:
        result = message.get("result")
        if isinstance(result, dict):
            result = _advertised(result)
            message = {**message, "result": result}
            self.replies["initialize"] = result
        if not self.init_answered:  # the client waits for this one
            self.told["initialize"] = result or {}
            if isinstance(result, dict) and isinstance(result.get("protocolVersion"), str):
                self.version = result["protocolVersion"]
            _send(self.stdout, _line({**message, "id": self.init.get("id")}))
        elif result != self.told["initialize"]:  # a bug: initialize_result.py no longer matches the server
            told = self.told["initialize"]
            differ = sorted(k for k in {**result, **told} if result.get(k) != told.get(k)) \
                if isinstance(result, dict) else [f"error {message.get('error')}"]
            print(f"warning: the SDK server's initialize result differs from the client's in {', '.join(differ)}",
                  file=sys.stderr, flush=True)
        self.replayed.set()

    def _remember(self) -> None:
        """Once the SDK answered what it was asked, the client hears of the lists it was told that differ, and its
        answers replace the remembered ones that differ."""
        offered = self.replies.get("initialize", {}).get("capabilities")
        if offered is None or any(c in offered and m not in self.replies for m, c in REMEMBERED.items()):
            return
        wanted = self.version
        replies, self.replies = self.replies, {}
        told = self.told.get("initialize", {}).get("capabilities") or {}
        for method, capability in REMEMBERED.items():
            if method in self.told and self.told[method] != replies.get(method) \
                    and (told.get(capability) or {}).get("listChanged") is True:
                _send(self.stdout, _line({"jsonrpc": "2.0", "method": f"notifications/{capability}/list_changed"}))
        if wanted is None or all(self.answers.get(m, {}).get(wanted) == r for m, r in replies.items()):
            return
        try:
            answers_file.remember(self.answers_file, wanted, replies)
        except (OSError, Untrusted) as e:
            print(f"warning: could not keep the MCP answers in {self.answers_file.path}: {e}", file=sys.stderr)
