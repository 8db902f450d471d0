"""Which files a tool argument may name: the client's MCP roots, else the allowed directories.

Over stdio the client is the user's own agent on this machine: the roots it declares are the
directories it may hand us; without roots, SCRIPTORIUM_MCP_ALLOWED_DIRS, by default the working
directory (unless that is / or the home directory: too broad, so then none). Over HTTP the client
may be anyone holding the token, so roots can only narrow what SCRIPTORIUM_MCP_ALLOWED_DIRS allows
(default: nothing): a client declaring file:/// as a root gains nothing.
"""

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal
from urllib.parse import urlparse
from urllib.request import url2pathname

from mcp.server.mcpserver import Context
from mcp.server.mcpserver.exceptions import ToolError
from mcp.server.mcpserver.resolve import ListRoots
from mcp.types import ListRootsResult

Transport = Literal["stdio", "http", "memory"]
SETTING = "SCRIPTORIUM_MCP_ALLOWED_DIRS"


class PathRefused(ToolError):
    """A file argument outside every directory this server may read."""


@dataclass(frozen=True)
class FileAccess:
    transport: Transport
    allowed: tuple[Path, ...]  # from the setting, or the transport's default
    why: str  # where `allowed` came from, for messages

    @classmethod
    def for_transport(cls, transport: Transport, configured: tuple[str, ...] | None,
                      cwd: Path | None = None) -> "FileAccess":
        if configured is not None:
            dirs = tuple(_directory(d) for d in configured)
            return cls(transport, dirs, SETTING)
        if transport == "http":
            return cls(transport, (), f"{SETTING} (unset: an HTTP server reads no files)")
        here = (cwd or Path.cwd()).resolve()
        if here == Path(here.anchor) or here == Path.home().resolve():
            return cls(transport, (), f"{SETTING} (unset, and the working directory {here} is too broad to allow)")
        return cls(transport, (here,), f"{SETTING} (unset: the working directory)")

    def directories(self, roots: tuple[Path, ...] | None) -> tuple[Path, ...]:
        """The directories a path may lie in for a client that declared `roots` (None: declared none)."""
        if roots is None:
            return self.allowed
        if self.transport != "http":
            return roots
        return tuple(r for r in roots if any(_inside(r, a) for a in self.allowed)) + \
            tuple(a for a in self.allowed if any(_inside(a, r) for r in roots))

    def check(self, value: str, roots: tuple[Path, ...] | None, what: str = "file") -> Path:
        """The resolved path of `value` if it lies inside an allowed directory; else PathRefused."""
        dirs = self.directories(roots)
        raw = Path(value).expanduser()
        if not raw.is_absolute():
            raw = (dirs[0] if dirs else Path.cwd()) / raw
        path = raw.resolve()  # symlinks and .. resolved: a link cannot lead outside
        if any(_inside(path, d) for d in dirs):
            return path
        raise PathRefused(self._refusal(value, path, dirs, roots, what))

    def _refusal(self, value: str, path: Path, dirs: tuple[Path, ...], roots, what: str) -> str:
        shown = ", ".join(str(d) for d in dirs) or "none"
        if roots is not None and self.transport != "http":
            source = "your client's roots"
        elif roots is not None:
            source = f"your client's roots within {self.why}"
        else:
            source = self.why
        hint = f"set {SETTING} to the directories (separated by {os.pathsep!r}) this server may read"
        if roots is not None and self.transport != "http":
            hint = "open the folder that holds it in your client (it sets the roots)"
        return (f"{what} {value!r} ({path}) is outside the directories this server may read: {shown} "
                f"(from {source}); {hint}")


def _directory(value: str) -> Path:
    return Path(value).expanduser().resolve()


def _inside(path: Path, directory: Path) -> bool:
    return path == directory or path.is_relative_to(directory)


def root_paths(result: ListRootsResult | None) -> tuple[Path, ...] | None:
    """The local directories of a client's roots (file:// URIs); None when the client declared no roots."""
    if result is None:
        return None
    paths = []
    for root in result.roots:
        uri = urlparse(str(root.uri))
        if uri.scheme == "file" and uri.netloc in ("", "localhost"):
            paths.append(Path(url2pathname(uri.path)).resolve())
    return tuple(paths)


def client_roots(ctx: Context) -> ListRoots | None:
    """A resolver: ask for the client's roots when it declares the capability (the SDK injects the answer)."""
    capabilities = ctx.client_capabilities
    if capabilities is not None and capabilities.roots is not None:
        return ListRoots()
    return None
