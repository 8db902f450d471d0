"""The stdio front's remembered answers, cache/mcp/answers-<code>.json: used only when their tag, the code that
made them and their shape all check out; otherwise ignored (with a one-line reason) and rewritten.

The file is one header line, `scriptorium-mcp-answers/1 <code> <tag>`, then the answers as JSON. The code is a
digest of this package's sources, the SDK and Python versions and the settings that shape the answers (the
toolsets, the budget): answers another version or toolset made are stale. The tag is an HMAC-SHA256 of the code
and the JSON's exact bytes, keyed by a secret of this install (state/mcp-answers.key: 32 random bytes, mode
0600, made at the first write). It keeps out answers from anyone who can put a file in the cache directory but
cannot read that key: another account where the cache is shared or synced, a tool that can write a file but
not read one, a cache copied or restored from another install. It does not stop a process running as this
user, which can read the key (and could as well edit this code).

Nothing here follows a link or blocks: the answers file and the key are opened with O_NOFOLLOW|O_NONBLOCK and
read only if they are regular files of bounded size; the lock is opened with O_NOFOLLOW and never truncated (a
link or a fifo in its place is removed, never its target); new answers and keys are renamed into place.
"""

import contextlib
import errno
import hashlib
import hmac
import json
import os
import secrets
import stat
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from common.files import atomic_write_bytes, fsync_dir
from common.paths import state_dir
from mcp_server import answers_schema

try:
    import fcntl
except ImportError:  # Windows: starts at once may keep one version's answers, not both
    fcntl = None

FORMAT = b"scriptorium-mcp-answers/1"
MAX_BYTES = 4 << 20  # a few dozen KiB per protocol version today
KEY_BYTES = 32
# Absent on Windows, where links and fifos are not what a cache directory holds.
_SAFE = getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)


class Untrusted(Exception):
    """Remembered answers (or their key) that are not used, and why."""


@dataclass(frozen=True)
class AnswersFile:
    path: Path  # cache/mcp/answers-<code[:16]>.json
    key: Path  # state/mcp-answers.key, shared by every toolset's answers
    code: str  # the full digest the file's header must carry

    @property
    def lock(self) -> Path:
        return self.path.with_suffix(".lock")


def locate(home: Path, toolsets: tuple[str, ...], budget: float | None) -> AnswersFile:
    """Where this code's answers are kept, for this SDK and these settings."""
    digest = hashlib.sha256()
    for path in sorted(Path(__file__).parent.glob("*.py")):
        digest.update(path.read_bytes())
    try:
        sdk = version("mcp")
    except PackageNotFoundError:
        sdk = "unknown"
    digest.update(json.dumps([list(toolsets), budget, sdk, sys.version]).encode())
    code = digest.hexdigest()
    return AnswersFile(
        home / "cache" / "mcp" / f"answers-{code[:16]}.json", state_dir(home) / "mcp-answers.key", code
    )


def read(file: AnswersFile) -> dict:
    """The remembered answers, {method: {protocol version: result}}; {} when none were kept. Raises Untrusted
    when there is a file that is not to be used."""
    try:
        data = _read_regular(file.path, "the answers file", MAX_BYTES)
    except FileNotFoundError:
        return {}
    header, _, body = data.partition(b"\n")
    parts = header.split(b" ")
    if len(parts) != 3 or parts[0] != FORMAT:
        raise Untrusted(f"{file.path} is not a remembered-answers file of this version")
    if parts[1] != file.code.encode():
        raise Untrusted(f"{file.path} was made by other code or settings (stale)")
    try:
        key = _read_key(file.key)
    except FileNotFoundError:
        raise Untrusted(
            f"{file.path} is tagged but this install has no key ({file.key}): not written here"
        ) from None
    if not hmac.compare_digest(parts[2], _tag(key, file.code, body).encode()):
        raise Untrusted(f"{file.path} has a tag this install's key did not make: not written here, or edited")
    try:
        answers = json.loads(body)
    except (ValueError, RecursionError):
        raise Untrusted(f"{file.path} is not JSON after its header") from None
    if found := answers_schema.problem(answers):
        raise Untrusted(f"{file.path} holds an answer unlike the server's: {found}")
    return answers


def remember(file: AnswersFile, protocol_version: str, results: dict[str, dict]) -> None:
    """Keep the SDK server's results for one protocol version beside those kept for others, under the lock.
    Raises OSError, or Untrusted when the results are not of the shape a later start would accept."""
    if found := answers_schema.problem({method: {protocol_version: r} for method, r in results.items()}):
        raise Untrusted(f"the server's answers are not kept: {found}")
    file.path.parent.mkdir(parents=True, exist_ok=True)
    with _locked(file.lock):
        try:
            answers = read(file)
        except Untrusted:
            answers = {}  # replaced as a whole
        for method, result in results.items():
            answers.setdefault(method, {})[protocol_version] = result
        body = json.dumps(answers, separators=(",", ":")).encode()
        key = _key_for_writing(file.key)
        atomic_write_bytes(
            file.path,
            b" ".join([FORMAT, file.code.encode(), _tag(key, file.code, body).encode()]) + b"\n" + body,
        )


def _tag(key: bytes, code: str, body: bytes) -> str:
    return hmac.new(key, FORMAT + b"\n" + code.encode() + b"\n" + body, hashlib.sha256).hexdigest()


def _open_regular(path: Path, flags: int, what: str) -> int:
    """A descriptor of path, which must be a regular file: a link is not followed, a fifo not waited on."""
    try:
        fd = os.open(path, flags | _SAFE, 0o600)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise Untrusted(f"{what} {path} is a symbolic link, not followed") from None
        if e.errno in (errno.ENOENT, errno.EEXIST):
            raise
        raise Untrusted(f"{what} {path} cannot be opened: {e.strerror}") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise Untrusted(f"{what} {path} is not a regular file")
    return fd


def _read_regular(path: Path, what: str, limit: int) -> bytes:
    fd = _open_regular(path, os.O_RDONLY, what)
    try:
        if os.fstat(fd).st_size > limit:
            raise Untrusted(f"{what} {path} is over {limit} bytes")
        chunks, size = [], 0
        while size <= limit and (chunk := os.read(fd, limit + 1 - size)):
            chunks.append(chunk)
            size += len(chunk)
    except OSError as e:
        raise Untrusted(f"{what} {path} cannot be read: {e.strerror}") from None
    finally:
        os.close(fd)
    if size > limit:
        raise Untrusted(f"{what} {path} is over {limit} bytes")
    return b"".join(chunks)


def _read_key(path: Path) -> bytes:
    """The install's key; Untrusted if others could read or write it, or it is not KEY_BYTES long."""
    fd = _open_regular(path, os.O_RDONLY, "the key")
    try:
        st = os.fstat(fd)
        if hasattr(os, "geteuid") and (st.st_uid != os.geteuid() or st.st_mode & 0o077):
            raise Untrusted(f"the key {path} is not private to this user (owner and mode 0600)")
        key = os.read(fd, KEY_BYTES + 1)
    finally:
        os.close(fd)
    if len(key) != KEY_BYTES:
        raise Untrusted(f"the key {path} is not {KEY_BYTES} bytes")
    return key


def _key_for_writing(path: Path) -> bytes:
    """The install's key, made if there is none; one that is not usable is replaced (renamed over, so a link
    in its place is replaced, never written through), which retires every answer it tagged."""
    try:
        return _read_key(path)
    except FileNotFoundError:
        replace = False
    except Untrusted as e:
        print(f"warning: a new key replaces this one: {e}", file=sys.stderr, flush=True)
        replace = True
    key = secrets.token_bytes(KEY_BYTES)
    if replace:
        atomic_write_bytes(path, key, mode=0o600)
        return key
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, partial = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")  # made 0600
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(key)
            out.flush()
            os.fsync(out.fileno())
        try:
            os.link(partial, path)  # whole or not there: starts at once for two toolsets agree on one key
        except FileExistsError:
            return _read_key(path)
    finally:
        os.unlink(partial)
    fsync_dir(path.parent)
    return key


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    fd = _open_lock(path)
    try:
        if fcntl:
            fcntl.flock(fd, fcntl.LOCK_EX)  # starts at once (install primes two) each add their version
        yield
    finally:
        os.close(fd)


def _open_lock(path: Path) -> int:
    """The lock file, opened to be locked, never truncated. A link or anything else but a regular file in its
    place is removed (the name, never what a link points to) and a new lock made."""
    for _ in range(3):
        try:
            return _open_regular(path, os.O_RDWR | os.O_CREAT, "the lock")
        except Untrusted as e:
            problem = e
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
    raise OSError(f"{problem}; it was removed but came back")
