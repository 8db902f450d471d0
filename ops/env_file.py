"""The project's .env, read as Docker Compose reads it, so `ops up` and `docker compose up` see the same values.

One KEY=VALUE (or KEY: VALUE) a statement. Blank lines, and lines whose first non-blank character is #, are
skipped; a leading `export ` is dropped; blanks around the key and after the = are dropped.
- Unquoted: the rest of the line, cut at the first " #" (a # right after a space starts a comment; `a#b` keeps
  its #), trailing blanks dropped. ${VAR} is interpolated.
- 'Single-quoted': literal ($, \\n and # are characters), but for \\' ; may span lines.
- "Double-quoted": \\n \\t \\r \\\\ \\" \\$ (a literal $) and the other C escapes, then ${VAR}; may span lines.
- A KEY alone takes the environment's value: it sets nothing the environment does not already.
After a closing quote only a comment may follow. ${VAR} looks in the environment first, then at the lines above.
"""

import re
from pathlib import Path

from ops.interpolation import InterpolationError, interpolate

_BLANK = "\t\v\f\r \x85\xa0"  # Compose's blanks within a line: any whitespace but the line break
_KEY = re.compile(r"[\w.\-\[\]]+")
_ESCAPE = re.compile(r"\\([abfnrtv\"\\$]|0[0-7]{3})")
_ESCAPES = {
    "a": "\a",
    "b": "\b",
    "f": "\f",
    "n": "\n",
    "r": "\r",
    "t": "\t",
    "v": "\v",
    '"': '"',
    "\\": "\\",
    "$": "$$",
}  # $$: a literal $ once the value is interpolated


class EnvFileError(Exception):
    """A .env line Compose would refuse too; the message names the file and line."""


def read_env_file(path: Path, environ: dict[str, str]) -> dict[str, str]:
    """The variables `path` sets, in order; `environ` is what ${VAR} in its values sees first."""
    return parse_env(path.read_text(encoding="utf-8").removeprefix("\ufeff"), environ, str(path))


def parse_env(text: str, environ: dict[str, str], where: str = ".env") -> dict[str, str]:
    values: dict[str, str] = {}
    pos = 0
    while True:
        pos = _skip(text, pos, str.isspace)
        if pos == len(text):
            return values
        line = text.count("\n", 0, pos) + 1
        if text[pos] == "#":
            pos = _line_end(text, pos)
            continue
        statement = re.match(r"export[^\S\n]+", text[pos:])
        pos += statement.end() if statement else 0
        end = _first(text, pos, "=:\n")
        key = text[pos:end].strip(_BLANK)
        if not _KEY.fullmatch(key):
            shown = text[pos : _line_end(text, pos)]
            raise EnvFileError(
                f"{where}, line {line}: {shown!r} is not KEY=VALUE (a key is letters, digits, _ . -)"
            )
        if end == len(text) or text[end] == "\n":  # KEY alone: the environment's value, if any
            pos = end
            continue
        pos = _skip(text, end + 1, lambda c: c in _BLANK)
        try:
            value, pos = _value(text, pos, {**values, **environ})
        except (EnvFileError, InterpolationError) as e:
            raise EnvFileError(f"{where}, line {line}: {key}: {e}") from None
        values[key] = value


def _value(text: str, pos: int, lookup: dict[str, str]) -> tuple[str, int]:
    """The value starting at pos, and where the statement ends."""
    quote = text[pos] if pos < len(text) and text[pos] in "'\"" else None
    if quote is None:
        end = _line_end(text, pos)
        raw = text[pos:end].split(" #", 1)[0].rstrip()
        return interpolate(raw, lookup), end
    chars, i, escaped = [], pos + 1, False
    while i < len(text):
        c = text[i]
        i += 1
        if escaped:
            chars.append(c if c == quote else "\\" + c)  # only the quote loses its backslash here
            escaped = False
        elif c == "\\":
            escaped = True
        elif c == quote:
            break
        else:
            chars.append(c)
    else:
        raise EnvFileError(f"the {quote} quote is never closed")
    rest = _skip(text, i, lambda c: c in _BLANK)
    if rest < len(text) and text[rest] not in "#\n":
        raise EnvFileError(
            f"{text[rest : _line_end(text, rest)]!r} follows the closing quote (only a comment may)"
        )
    value = "".join(chars)
    if quote == '"':
        value = interpolate(_ESCAPE.sub(_unescape, value), lookup)
    return value, _line_end(text, rest)


def _unescape(m: re.Match) -> str:
    code = m.group(1)
    if len(code) > 1:  # \0 and three octal digits: one byte's character
        return chr(int(code[1:], 8)) if int(code[1:], 8) < 256 else m.group(0)
    return _ESCAPES[code]


def _skip(text: str, pos: int, blank) -> int:
    while pos < len(text) and blank(text[pos]):
        pos += 1
    return pos


def _first(text: str, pos: int, stops: str) -> int:
    while pos < len(text) and text[pos] not in stops:
        pos += 1
    return pos


def _line_end(text: str, pos: int) -> int:
    end = text.find("\n", pos)
    return len(text) if end < 0 else end
