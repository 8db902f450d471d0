"""Chat templates rendered as transformers' apply_chat_template renders them (the reference every model's
template is written for), with jinja2 alone: importing transformers costs a second of every start.

What a template sees and may call is transformers' contract: a sandbox with trim_blocks and lstrip_blocks,
loop controls, a `{% generation %}` block, `tojson` that keeps non-ASCII text, `raise_exception`,
`strftime_now`, the messages (keys set to None left out, reasoning under all three of its names), tools, documents,
add_generation_prompt, the named special tokens and any extra variables. Checked against transformers
itself in tests/backend/test_plain_tokenizer.py.
"""

import dataclasses
import json
from collections.abc import Mapping
from datetime import datetime
from functools import lru_cache

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks what the assistant wrote (for training masks); it
    renders its body unchanged."""
    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller) -> str:
        return caller()


class _Namespace(jinja2.utils.Namespace):
    """jinja's namespace() without underscore names, which would reach Python internals."""

    def __init__(*args, **kwargs):
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._refuse(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _Namespace._refuse(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _refuse(name) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"a chat template cannot set {name!r} on a namespace")


class _Dict:
    """dict() for templates, without the type's other attributes."""

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@lru_cache(maxsize=32)
def compiled(template: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationBlock, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=lambda fmt: datetime.now().strftime(fmt),
                       dict=_Dict(), namespace=_Namespace)
    return env.from_string(template)


def plain(value):
    """What a template may see: JSON types rebuilt (dataclasses and pydantic models as dicts), anything else
    as an inert "<TypeName>" placeholder, so no object's methods reach the sandbox."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    for kind, convert in ((str, str.__str__), (int, int.__int__), (float, float.__float__)):
        if isinstance(value, kind):
            return convert(value)
    if isinstance(value, Mapping):
        return {plain(k): plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(plain(v) for v in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):
        return plain(value.model_dump())
    return f"<{type(value).__name__}>"


def _with_reasoning_names(message: dict) -> dict:
    """A message's reasoning under every name templates read it by (reasoning_content; gpt-oss: thinking)."""
    reasoning = next((message[k] for k in REASONING_FIELDS if message.get(k) is not None), None)
    return message if reasoning is None else {"thinking": reasoning, **message, "reasoning_content": reasoning}


def render(template: str, messages: list, *, tools: list[dict] | None = None, documents: list[dict] | None = None,
           add_generation_prompt: bool = False, **variables) -> str:
    """The conversation as the template writes it. Raises jinja2's TemplateError for what the template refuses
    (its raise_exception), TypeError for a message or document that is not a dict."""
    chat = plain(list(messages))
    if any(not isinstance(m, dict) for m in chat):
        raise TypeError("chat messages must be dicts (or dataclasses, or pydantic models)")
    # a key set to None (the OpenAI SDK's content=None, tool_calls=None) is a key left out: templates test for keys
    chat = [{k: v for k, v in m.items() if v is not None} for m in chat]
    if documents is not None and any(not isinstance(d, dict) for d in documents):
        raise TypeError("documents must be dicts with 'title' and 'text' keys")
    for tool in tools or []:
        if not isinstance(tool, dict):
            raise ValueError("tools must be JSON schemas (dicts)")
    return compiled(template).render(messages=[_with_reasoning_names(m) for m in chat], tools=plain(tools),
                                     documents=plain(documents), add_generation_prompt=add_generation_prompt,
                                     **plain(variables))
