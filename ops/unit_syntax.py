"""Writing values into systemd unit files and environment files so that systemd reads back exactly them.

A unit file is line-based: a newline in a value would end the setting and start another (a directive
injected by whoever wrote the value). Each kind of setting is quoted by its own rules (systemd.syntax,
systemd.service "Command lines", systemd.exec Environment= and EnvironmentFile=).
"""

import re

from ops.stack import StackError

_SPECIAL = re.compile(r"[\s\"'\\;]|[\x00-\x1f\x7f]")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_ESCAPES = {"\\": "\\\\", '"': '\\"', "\n": "\\n", "\t": "\\t", "\r": "\\r"}


def _c_quoted(text: str) -> str:
    """A double-quoted word with C escapes, which systemd decodes in Exec and Environment lines."""
    if "\0" in text:
        raise StackError("a NUL character cannot be passed through a systemd unit")
    return '"' + "".join(_ESCAPES.get(c) or (f"\\x{ord(c):02x}" if _CONTROL.match(c) else c) for c in text) + '"'


def exec_word(arg) -> str:
    """One argument of an Exec line: % is a specifier and $ a variable there, so both are doubled;
    anything with whitespace, quotes, backslashes, ';' or control characters is quoted and escaped."""
    arg = str(arg).replace("%", "%%").replace("$", "$$")
    return _c_quoted(arg) if arg == "" or _SPECIAL.search(arg) else arg


def exec_line(args: list[str]) -> str:
    return " ".join(exec_word(a) for a in args)


def environment(name: str, value) -> str:
    """The value of an Environment= setting: specifiers are expanded there, variables are not."""
    if not _ENV_NAME.fullmatch(name):
        raise StackError(f"{name!r} is not a valid environment variable name for a systemd unit")
    return _c_quoted(f"{name}={value}".replace("%", "%%"))


def path(value) -> str:
    """A path setting (WorkingDirectory=, EnvironmentFile=): taken verbatim to the end of the line, so
    it cannot carry a newline; % is still a specifier."""
    text = str(value)
    if _CONTROL.search(text):
        raise StackError(f"the path {text!r} contains control characters and cannot be put into a systemd unit")
    return text.replace("%", "%%")


def text(value) -> str:
    """Free text (Description=): one line, % doubled."""
    return path(value)


def env_file_line(name: str, value) -> str:
    """One assignment of an EnvironmentFile: double-quoted as in a POSIX shell, where \\ " $ and ` are
    escaped and a newline stays part of the value."""
    if not _ENV_NAME.fullmatch(name):
        raise StackError(f"{name!r} is not a valid environment variable name")
    if "\0" in str(value):
        raise StackError(f"the value of {name} contains a NUL character")
    return f'{name}="' + re.sub(r'([\\"$`])', r"\\\1", str(value)) + '"\n'
