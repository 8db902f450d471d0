"""The backup's view of the disk: only regular files and directories, never anything reached through a link.

Below a base directory the person chose (the data directory, a backup, the restore target) every path is
opened one component at a time with O_NOFOLLOW, so a symbolic link anywhere below the base, even one swapped
in while a backup runs, is refused rather than followed. The base itself may be a link: the person named it.
Fifos, sockets and devices are never opened (opening one can block or act on hardware). A regular file with
more hard links than names inside the tree being copied shares its bytes with a file outside it, which a
backup must not carry off either. What the backup code writes, renames or deletes below such a base is
reached the same way: new files made with O_EXCL|O_NOFOLLOW in a directory opened without following links,
trees deleted by walking directory descriptors, where a link is removed itself and never followed.
"""

import contextlib
import errno
import hashlib
import os
import stat
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FILE = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_NEW = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_KINDS = {stat.S_IFLNK: "a symbolic link", stat.S_IFIFO: "a fifo", stat.S_IFSOCK: "a socket",
          stat.S_IFBLK: "a block device", stat.S_IFCHR: "a character device", stat.S_IFDIR: "a directory",
          stat.S_IFREG: "a regular file"}


class Unsafe(Exception):
    """A path that is a link, or not what it must be (a directory, a regular file): never followed nor written."""


def kind(mode: int) -> str:
    return _KINDS.get(stat.S_IFMT(mode), "not a regular file")


def skip_note(mode: int) -> str:
    what = kind(mode)
    return f"{what}, not followed" if stat.S_ISLNK(mode) else f"{what}, skipped"


def _open_dir(name: str, dir_fd: int, shown: str) -> int:
    try:
        return os.open(name, _DIR, dir_fd=dir_fd)
    except OSError as e:
        if e.errno not in (errno.ELOOP, errno.ENOTDIR):
            raise
        raise Unsafe(f"{shown} is {kind(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode)}, "
                     "not a directory") from None


def open_dirs(base: Path, parts: list[str], create: bool = False) -> int:
    """A descriptor of the directory base/parts[0]/parts[1]/..., each part a real directory (made if create)."""
    fd = os.open(base, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for i, part in enumerate(parts):
            if create:
                with contextlib.suppress(FileExistsError):
                    os.mkdir(part, dir_fd=fd)
            inner = _open_dir(part, fd, "/".join(parts[: i + 1]))
            os.close(fd)
            fd = inner
    except BaseException:
        os.close(fd)
        raise
    return fd


def new_file(name: str, dir_fd: int) -> BinaryIO:
    """A new regular file `name` in the directory open as dir_fd, for writing: made with O_EXCL, so never an
    existing file nor the target of a link planted at that name."""
    return os.fdopen(os.open(name, _NEW, 0o600, dir_fd=dir_fd), "wb")


def remove_tree(dir_fd: int, name: str) -> None:
    """Delete `name` from the directory open as dir_fd and, if it is a directory, everything below it, walking
    by directory descriptors: a link met anywhere is removed itself, never followed, so nothing outside is
    touched even if the tree changes meanwhile."""
    try:
        fd = os.open(name, _DIR, dir_fd=dir_fd)
    except FileNotFoundError:
        return
    except OSError as e:
        if e.errno not in (errno.ELOOP, errno.ENOTDIR):
            raise
        with contextlib.suppress(FileNotFoundError):
            os.unlink(name, dir_fd=dir_fd)  # a file, a link or a fifo: unlink removes the name, never a target
        return
    try:
        for inner in os.listdir(fd):
            remove_tree(fd, inner)
    finally:
        os.close(fd)
    os.rmdir(name, dir_fd=dir_fd)


def open_file(base: Path, relative: str) -> int:
    """A descriptor for reading base/relative: a regular file reached through real directories only."""
    *dirs, name = relative.split("/")
    dir_fd = open_dirs(base, dirs)
    try:
        mode = os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode
        if not stat.S_ISREG(mode):  # checked before opening: a device or fifo is never opened
            raise Unsafe(f"{relative} is {kind(mode)}")
        try:
            fd = os.open(name, _FILE, dir_fd=dir_fd)
        except OSError as e:
            if e.errno == errno.ELOOP:  # replaced by a link since the stat
                raise Unsafe(f"{relative} is a symbolic link") from None
            raise
    finally:
        os.close(dir_fd)
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise Unsafe(f"{relative} is {kind(mode)}")
    return fd


def open_one(path: Path) -> int:
    """A descriptor for reading a file the person named (a config): its last component is not followed."""
    return open_file(path.parent, path.name)


def sha256_fd(fd: int) -> str:
    os.lseek(fd, 0, os.SEEK_SET)
    with os.fdopen(fd, "rb", closefd=False) as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def copy_fd(source: int, target) -> dict:
    """Copy from a descriptor into an open binary file, hashing the bytes as they are written, and fsync it.
    Keeps the mode and the mtime, never the owner (a restore run as root must not hand files to anyone)."""
    digest, size = hashlib.sha256(), 0
    os.lseek(source, 0, os.SEEK_SET)
    while chunk := os.read(source, 1 << 20):
        target.write(chunk)
        digest.update(chunk)
        size += len(chunk)
    target.flush()
    st = os.fstat(source)
    os.fchmod(target.fileno(), stat.S_IMODE(st.st_mode))
    os.utime(target.fileno(), ns=(st.st_atime_ns, st.st_mtime_ns))
    os.fsync(target.fileno())
    return {"sha256": digest.hexdigest(), "size": size}


def write_problem(base: Path, relative: str) -> str | None:
    """Why base/relative cannot be written as a regular file without going through a link or over
    something else (a directory, a fifo), or None."""
    parts = relative.split("/")
    current = base
    for i, part in enumerate(parts):
        current = current / part
        try:
            mode = current.lstat().st_mode
        except FileNotFoundError:
            return None
        shown = "/".join(parts[: i + 1])
        if stat.S_ISLNK(mode):
            return f"{shown} is a symbolic link"
        if i < len(parts) - 1 and not stat.S_ISDIR(mode):
            return f"{shown} is {kind(mode)}, not a directory"
        if i == len(parts) - 1 and not stat.S_ISREG(mode):
            return f"{shown} is {kind(mode)}"
    return None


@dataclass
class Found:
    path: str  # relative to the base, "runs/x/a.md"
    links: int  # how many names the file has inside the tree: more at copy time means one outside appeared


@dataclass
class Tree:
    files: list[Found] = field(default_factory=list)
    skipped: list[dict] = field(default_factory=list)  # {"path", "note"}: what was not copied, and why


def scan(base: Path, top: str, ignore=lambda name: False) -> Tree:
    """The regular files under base/top (paths relative to base, sorted), and what is not copied with why:
    links, special files, unreadable directories, files hard-linked to a name outside base/top."""
    tree = Tree()
    try:
        mode = (base / top).lstat().st_mode
    except FileNotFoundError:
        return tree
    if not stat.S_ISDIR(mode):
        tree.skipped.append({"path": top, "note": skip_note(mode)})
        return tree

    def unreadable(e: OSError) -> None:  # fwalk names a directory it cannot open by its last component only
        name = Path(str(e.filename or top))
        where = name.relative_to(base) if name.is_absolute() and name.is_relative_to(base) else name
        tree.skipped.append({"path": f"{top}/.../{where}" if not name.is_absolute() else str(where),
                             "note": f"a directory that cannot be read ({e.strerror}), skipped"})

    found: list[tuple[str, os.stat_result]] = []
    names: Counter = Counter()
    for dirpath, dirnames, filenames, dir_fd in os.fwalk(base / top, onerror=unreadable, follow_symlinks=False):
        here = Path(dirpath).relative_to(base)
        real_dirs = []
        for name in sorted(dirnames + filenames):
            try:
                st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
            except FileNotFoundError:
                continue  # removed meanwhile
            relative = str(here / name)
            if stat.S_ISDIR(st.st_mode):
                real_dirs.append(name)
            elif stat.S_ISREG(st.st_mode):
                if not ignore(name):
                    found.append((relative, st))
                    names[(st.st_dev, st.st_ino)] += 1
            else:
                tree.skipped.append({"path": relative, "note": skip_note(st.st_mode)})
        dirnames[:] = real_dirs  # a link to a directory is listed above as skipped, never entered
    for relative, st in sorted(found):
        inside = names[(st.st_dev, st.st_ino)]
        if st.st_nlink > inside:
            tree.skipped.append({"path": relative, "note": f"has {st.st_nlink} hard links, {st.st_nlink - inside} "
                                                           f"outside {top}/: its bytes may be another file's, skipped"})
        else:
            tree.files.append(Found(relative, inside))
    tree.skipped.sort(key=lambda s: s["path"])
    return tree
