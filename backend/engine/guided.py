"""Structured output: sampling constrained to valid JSON (any object, or one matching a JSON schema).

Grammars are compiled by xgrammar against the model's tokenizer; each constrained sequence
keeps a matcher that says which tokens may come next, applied as a mask to its logits.
Compiling happens off the engine thread (a large schema takes seconds), so the cache of
compiled grammars is shared under a lock and bounded: the least recently used goes first.
"""

import json
import threading
from collections import OrderedDict

import torch

from backend.sampling_params import InvalidParameter

MAX_GRAMMARS = 64  # compiled grammars kept; each holds token masks of the whole vocabulary
COMPILER_CACHE_BYTES = 256 << 20  # xgrammar's own cache of rule masks
MAX_SCHEMA_DEPTH = 32  # objects and arrays nested in a schema; deeper ones are refused before compiling


def grammar_tokenizer_info(xgrammar, tokenizer, vocab_size: int):
    """xgrammar's view of the vocabulary: from_huggingface's for a transformers tokenizer; for a PlainTokenizer
    the same fields from the same sources (its vocabulary, tokenizer.json's decoder and normalizer, its EOS)."""
    from backend.plain_tokenizer import PlainTokenizer

    if not isinstance(tokenizer, PlainTokenizer):
        return xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
    encoded = [""] * vocab_size
    for token, tid in tokenizer.get_vocab().items():
        if tid < vocab_size:
            encoded[tid] = token
    found = xgrammar.TokenizerInfo._detect_metadata_from_hf(tokenizer.backend_tokenizer.to_str())
    eos = tokenizer.eos_token_id
    return xgrammar.TokenizerInfo(encoded, found["vocab_type"], vocab_size=vocab_size,
                                  stop_token_ids=[eos] if eos is not None else None,
                                  add_prefix_space=found["add_prefix_space"])


class GuidedDecoding:
    def __init__(self, tokenizer, vocab_size: int, max_grammars: int = MAX_GRAMMARS, max_schema_bytes: int = 256 << 10):
        import xgrammar

        self.xgr = xgrammar
        self.vocab_size = vocab_size
        self.max_grammars = max_grammars
        self.max_schema_bytes = max_schema_bytes
        self.info = grammar_tokenizer_info(xgrammar, tokenizer, vocab_size)
        self.compiler = xgrammar.GrammarCompiler(self.info, cache_limit_bytes=COMPILER_CACHE_BYTES)
        self._grammars: OrderedDict[str, object] = OrderedDict()
        self._lock = threading.Lock()

    @property
    def num_grammars(self) -> int:
        return len(self._grammars)

    def _compile(self, key: str, guided_json: dict | bool):
        try:
            if guided_json is True:
                return self.compiler.compile_builtin_json_grammar()
            ebnf = str(self.xgr.Grammar.from_json_schema(key, any_whitespace=False))
            # xgrammar's rule for length-limited strings admits raw control characters, which JSON
            # forbids inside strings (json.loads rejects them); exclude them as its other string rules do.
            ebnf = ebnf.replace(r'[^\"\\\r\n]', r'[^\0-\x1f\"\\\r\n]')
            return self.compiler.compile_grammar(ebnf)
        except Exception as e:  # xgrammar reports unsupported or malformed schemas as RuntimeError
            raise InvalidParameter("guided_json", f"guided_json: the JSON schema cannot be used: {e}") from None

    def _key(self, guided_json: dict | bool) -> str:
        """The schema's key in the cache, once it is within the size and depth limits (InvalidParameter if not)."""
        # Not sorted: properties come out in the schema's order (a tool call's name before its arguments).
        key = "object" if guided_json is True else json.dumps(guided_json)
        if len(key) > self.max_schema_bytes:
            raise InvalidParameter("guided_json", f"guided_json: the JSON schema is {len(key)} bytes, more than this "
                                   f"server compiles ({self.max_schema_bytes}, serve --max-schema-bytes); shorten it "
                                   "(a long enum, for one)")
        if _depth(guided_json) > MAX_SCHEMA_DEPTH:
            raise InvalidParameter("guided_json", f"guided_json: the JSON schema nests more than {MAX_SCHEMA_DEPTH} "
                                   "levels of objects and arrays; flatten it")
        return key

    def compiled(self, guided_json: dict | bool) -> bool:
        """Whether the schema's grammar is in the cache (a matcher then costs no compile); checks its limits first.
        Thread-safe."""
        key = self._key(guided_json)
        with self._lock:
            return key in self._grammars

    def matcher(self, guided_json: dict | bool):
        """A fresh matcher for one sequence; compiled grammars are shared between requests. Thread-safe."""
        key = self._key(guided_json)
        with self._lock:
            grammar = self._grammars.get(key)
            if grammar is not None:
                self._grammars.move_to_end(key)
        if grammar is None:
            grammar = self._compile(key, guided_json)  # outside the lock: others' cache hits go on meanwhile
            with self._lock:
                self._grammars[key] = grammar
                self._grammars.move_to_end(key)
                while len(self._grammars) > self.max_grammars:
                    self._grammars.popitem(last=False)
        return self.xgr.GrammarMatcher(grammar)

    def mask(self, logits: torch.Tensor, matchers: list) -> None:
        """Set to -inf, in place, every token a row's matcher does not allow next (rows without one untouched)."""
        rows = [i for i, m in enumerate(matchers) if m is not None]
        if not rows:
            return
        bitmask = self.xgr.allocate_token_bitmask(len(matchers), self.vocab_size)
        for i in rows:
            matchers[i].fill_next_token_bitmask(bitmask, i)
        # The matchers fill the mask on the host; xgrammar applies it only on the logits' own device.
        self.xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device, non_blocking=True),
                                             vocab_size=self.vocab_size, indices=rows)


def _depth(value, level: int = 0) -> int:
    """How deeply objects and arrays nest in a JSON value (iteratively bounded: stops counting past the limit)."""
    if level > MAX_SCHEMA_DEPTH or not isinstance(value, (dict, list)):
        return level
    children = value.values() if isinstance(value, dict) else value
    return max((_depth(child, level + 1) for child in children), default=level + 1)
