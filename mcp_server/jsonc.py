"""JSON with comments and trailing commas (VS Code's mcp.json is JSONC), read and edited in place.

`loads` parses it; `set_member`, `delete_member`, `append_item` and `remove_item` change one value
and leave every other character of the file (comments, layout, key order) as it was.
"""

import json
import re
from dataclasses import dataclass, field

_TOKEN = re.compile(r'\s+|//[^\n]*|/\*.*?\*/|"(?:[^"\\]|\\.)*"|[{}\[\]:,]|[^\s{}\[\]:,"/]+|/', re.S)


class JSONCError(ValueError):
    pass


@dataclass
class Node:
    start: int
    end: int  # one past the last character
    kind: str  # object | array | scalar
    members: list["Member"] = field(default_factory=list)  # objects
    items: list["Node"] = field(default_factory=list)  # arrays
    value: object = None  # scalars


@dataclass
class Member:
    key: str
    start: int  # the key's opening quote
    value: Node


def _tokens(text: str) -> list[tuple[str, int]]:
    out, pos = [], 0
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if m is None or m.group() == "/":
            raise JSONCError(f"unexpected character at offset {pos}")
        tok = m.group()
        if not (tok[0].isspace() or tok.startswith(("//", "/*"))):
            out.append((tok, pos))
        pos = m.end()
    return out


class _Parser:
    def __init__(self, text: str):
        self.tokens = _tokens(text)
        self.i = 0

    def peek(self) -> str:
        if self.i >= len(self.tokens):
            raise JSONCError("unexpected end of file")
        return self.tokens[self.i][0]

    def take(self, expected: str | None = None) -> tuple[str, int]:
        tok = self.tokens[self.i] if self.i < len(self.tokens) else ("", -1)
        if expected is not None and tok[0] != expected:
            raise JSONCError(f"expected {expected!r} at offset {tok[1]}, found {tok[0]!r}")
        self.i += 1
        return tok

    def member(self) -> Member:
        key, kpos = self.take()
        if not key.startswith('"'):
            raise JSONCError(f"expected a quoted key at offset {kpos}, found {key!r}")
        self.take(":")
        return Member(json.loads(key), kpos, self.value())

    def elements(self, node: Node, close: str, read, into: list) -> Node:
        """The comma-separated elements (read by `read`) of the object or array `node` up to `close`."""
        while self.peek() != close:
            into.append(read())
            if self.peek() == ",":
                self.take()
            elif self.peek() != close:
                raise JSONCError(f"expected ',' or {close!r} at offset {self.tokens[self.i][1]}")
        node.end = self.take(close)[1] + 1
        return node

    def value(self) -> Node:
        tok, pos = self.take()
        if tok == "{":
            node = Node(pos, 0, "object")
            return self.elements(node, "}", self.member, node.members)
        if tok == "[":
            node = Node(pos, 0, "array")
            return self.elements(node, "]", self.value, node.items)
        try:
            return Node(pos, pos + len(tok), "scalar", value=json.loads(tok))
        except json.JSONDecodeError:
            raise JSONCError(f"unexpected {tok!r} at offset {pos}") from None


def parse(text: str) -> Node:
    parser = _Parser(text)
    root = parser.value()
    if parser.i != len(parser.tokens):
        raise JSONCError(
            f"unexpected {parser.tokens[parser.i][0]!r} after the end at offset {parser.tokens[parser.i][1]}"
        )
    return root


def plain(node: Node):
    if node.kind == "object":
        return {m.key: plain(m.value) for m in node.members}
    if node.kind == "array":
        return [plain(n) for n in node.items]
    return node.value


def loads(text: str):
    return plain(parse(text)) if text.strip() else {}


# Editing ------------------------------------------------------------------------------------------------


def _indent_at(text: str, pos: int) -> str:
    line_start = text.rfind("\n", 0, pos) + 1
    return re.match(r"[ \t]*", text[line_start:]).group()


def _render(value, indent: str, unit: str) -> str:
    return json.dumps(value, indent=len(unit) if unit.strip(" ") == "" else unit).replace("\n", "\n" + indent)


def _unit(text: str) -> str:
    m = re.search(r"\n([ \t]+)\S", text)
    return m.group(1) if m else "  "


def _find(root: Node, path: list[str]) -> Node | None:
    node = root
    for key in path:
        if node.kind != "object":
            return None
        node = next((m.value for m in node.members if m.key == key), None)
        if node is None:
            return None
    return node


def _insert(text: str, container: Node, piece: str, existing: list[int], unit: str) -> str:
    """Add `piece` as the last member/item of `container` (existing: the start offsets of its children)."""
    close = container.end - 1
    base = _indent_at(text, container.start)
    inner = base + unit
    if not existing:
        between = text[container.start + 1 : close].rstrip()
        return text[: container.start + 1] + between + f"\n{inner}{piece}\n{base}" + text[close:]
    last = _child_end(text, container, existing[-1])
    after = [t for t in _tokens(text[:close]) if t[1] >= last]
    comma = after[0][1] if after and after[0][0] == "," else None
    anchor = comma + 1 if comma is not None else last
    newline = text.find("\n", anchor)
    at = close if newline == -1 or newline > close else newline  # after a comment ending that line
    closing = f"\n{base}" if at == close else ""
    if comma is not None:  # the file ends its lists with a comma: so does ours
        return text[:at].rstrip(" \t") + f"\n{inner}{piece}," + closing + text[at:]
    return text[:last] + "," + text[last:at].rstrip(" \t") + f"\n{inner}{piece}" + closing + text[at:]


def _child_end(text: str, container: Node, start: int) -> int:
    for m in container.members:
        if m.start == start:
            return m.value.end
    for n in container.items:
        if n.start == start:
            return n.end
    raise JSONCError("internal: child not found")


def set_member(text: str, path: list[str], value) -> str:
    """Set the value at `path` (object keys), creating the objects on the way; the rest stays as written."""
    if not text.strip():
        text = "{}\n"
    root = parse(text)
    unit = _unit(text)
    node = _find(root, path)
    if node is not None:
        member_indent = _indent_at(text, node.start)
        return text[: node.start] + _render(value, member_indent, unit) + text[node.end :]
    for depth in range(len(path) - 1, -1, -1):  # the deepest object that exists
        parent = _find(root, path[:depth])
        if parent is not None:
            break
    if parent.kind != "object":
        raise JSONCError(f"{'.'.join(path[:depth]) or 'the top level'} is not an object")
    nested = value
    for key in reversed(path[depth + 1 :]):
        nested = {key: nested}
    inner = _indent_at(text, parent.start) + unit
    piece = json.dumps(path[depth]) + ": " + _render(nested, inner, unit)
    return _insert(text, parent, piece, [m.start for m in parent.members], unit)


def delete_member(text: str, path: list[str]) -> str:
    root = parse(text)
    parent = _find(root, path[:-1])
    if parent is None or parent.kind != "object":
        return text
    members = parent.members
    index = next((i for i, m in enumerate(members) if m.key == path[-1]), None)
    if index is None:
        return text
    return _cut(text, parent, [(m.start, m.value.end) for m in members], index)


def append_item(text: str, path: list[str], value) -> str:
    root = parse(text)
    array = _find(root, path)
    if array is None:
        return set_member(text, path, [value])
    if array.kind != "array":
        raise JSONCError(f"{'.'.join(path)} is not an array")
    unit = _unit(text)
    inner = _indent_at(text, array.start) + unit
    return _insert(text, array, _render(value, inner, unit), [n.start for n in array.items], unit)


def remove_item(text: str, path: list[str], index: int) -> str:
    array = _find(parse(text), path)
    if array is None or array.kind != "array" or not 0 <= index < len(array.items):
        return text
    return _cut(text, array, [(n.start, n.end) for n in array.items], index)


def _cut(text: str, container: Node, spans: list[tuple[int, int]], index: int) -> str:
    """Remove child `index` with its separating comma, and the line it stood on when it stood alone."""
    start, end = spans[index]
    after = [t for t in _tokens(text[: container.end - 1]) if t[1] >= end]
    comma_before = None
    if after and after[0][0] == ",":
        end = after[0][1] + 1
    elif index > 0:  # the last child, without a trailing comma: the comma before it goes
        before = [t for t in _tokens(text[:start]) if t[1] >= spans[index - 1][1]]
        comma_before = next(t[1] for t in before if t[0] == ",")
    line_start = text.rfind("\n", 0, start) + 1
    newline = text.find("\n", end)
    rest = text[end : newline if newline != -1 else len(text)]
    if not text[line_start:start].strip() and (not rest.strip() or rest.strip().startswith("//")):
        start, end = line_start, (newline + 1 if newline != -1 else len(text))
    text = text[:start] + text[end:]
    if comma_before is not None:
        text = text[:comma_before] + text[comma_before + 1 :]
    return text
