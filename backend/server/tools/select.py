"""Which parser reads a model's tool calls: from --tool-call-parser, else its chat template, else its family."""

from backend.server.tools.conversation import PHI4_MINI_TOOLS
from backend.server.tools.parsers import PARSERS, JsonArrayParser, NamedParser, ToolParser
from backend.server.tools.tool_defs import ToolSpec

FAMILY_PARSERS = {"LlamaForCausalLM": "llama3_json", "MistralForCausalLM": "mistral",
                  "MixtralForCausalLM": "mistral"}


def parser_name(override: str | None, template: str | None, architecture: str) -> str:
    if override:
        return override
    text = template or ""
    if "<tool_call>" in text:
        return "hermes"
    if "[TOOL_CALLS]" in text:
        return "mistral"
    if PHI4_MINI_TOOLS in text:
        return "phi4_mini_json"
    if "<|python_tag|>" in text or ("ipython" in text and "parameters" in text):
        return "llama3_json"
    if "tools" not in text:
        return "hermes"  # we write the Hermes format into the prompt ourselves (backend/server/tools/conversation.py)
    return FAMILY_PARSERS.get(architecture, "hermes")


def special_tokens(tokenizer) -> set[str]:
    return set(getattr(tokenizer, "all_special_tokens", None) or [])


def keeps_special_tokens(spec: ToolSpec | None, name: str, tokenizer) -> bool:
    """Whether the detokenizer must keep special tokens: the format's markers are special tokens."""
    if spec is None or spec.choice != "auto":
        return False
    return bool(set(PARSERS[name].markers) & special_tokens(tokenizer))


def make_parser(spec: ToolSpec | None, name: str, tokenizer, keep_special: bool) -> ToolParser | None:
    """A fresh parser for one choice's output (None: no calls are possible, the text is all content)."""
    if spec is None or not spec.calls_possible:
        return None
    strip = tuple(sorted(special_tokens(tokenizer))) if keep_special else ()
    if spec.choice == "named":
        return NamedParser(spec.function, strip)
    if spec.choice == "required":
        return JsonArrayParser(strip)
    return PARSERS[name](strip)
