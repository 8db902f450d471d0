"""Tool calls out of a model's text, one parser per family's format, fed the text as it is generated.

Each parser turns text into events: Content for text that is the answer, and CallStart / CallArguments /
CallEnd (backend/server/tools/scanner.py) for calls. Text that could still become a marker is held back
until it cannot, so content never carries half a `<tool_call>`. A marker followed by something that is
not a call object is content after all. Each format is described in its parser's module.
"""

from backend.server.tools.parsers.base import Content, ToolParser
from backend.server.tools.parsers.grammar import JsonArrayParser, NamedParser
from backend.server.tools.parsers.hermes import HermesParser
from backend.server.tools.parsers.llama3 import Llama3JsonParser
from backend.server.tools.parsers.mistral import MistralParser
from backend.server.tools.parsers.phi4_mini import Phi4MiniParser

__all__ = ["Content", "HermesParser", "JsonArrayParser", "Llama3JsonParser", "MistralParser", "NamedParser", "PARSERS",
           "Phi4MiniParser", "ToolParser"]

PARSERS = {p.name: p for p in (HermesParser, Llama3JsonParser, MistralParser, Phi4MiniParser, JsonArrayParser)}
