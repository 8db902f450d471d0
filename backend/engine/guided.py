"""Structured output: sampling constrained to valid JSON (any object, or one matching a JSON schema).

Grammars are compiled by xgrammar against the model's tokenizer; each constrained sequence
keeps a matcher that says which tokens may come next, applied as a mask to its logits.
"""

import json

import torch

from backend.sampling_params import InvalidParameter


class GuidedDecoding:
    def __init__(self, tokenizer, vocab_size: int):
        import xgrammar

        self.xgr = xgrammar
        self.vocab_size = vocab_size
        self.info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        self.compiler = xgrammar.GrammarCompiler(self.info)
        self._grammars: dict[str, object] = {}

    def matcher(self, guided_json: dict | bool):
        """A fresh matcher for one sequence; compiled grammars are shared between requests."""
        key = "object" if guided_json is True else json.dumps(guided_json, sort_keys=True)
        grammar = self._grammars.get(key)
        if grammar is None:
            try:
                if guided_json is True:
                    grammar = self.compiler.compile_builtin_json_grammar()
                else:
                    ebnf = str(self.xgr.Grammar.from_json_schema(key, any_whitespace=False))
                    # xgrammar's rule for length-limited strings admits raw control characters, which JSON
                    # forbids inside strings (json.loads rejects them); exclude them as its other string rules do.
                    ebnf = ebnf.replace(r'[^\"\\\r\n]', r'[^\0-\x1f\"\\\r\n]')
                    grammar = self.compiler.compile_grammar(ebnf)
            except Exception as e:  # xgrammar reports unsupported or malformed schemas as RuntimeError
                raise InvalidParameter("guided_json", f"guided_json: the JSON schema cannot be used: {e}") from None
            self._grammars[key] = grammar
        return self.xgr.GrammarMatcher(grammar)

    def mask(self, logits: torch.Tensor, matchers: list) -> None:
        """Set to -inf, in place, every token a row's matcher does not allow next (rows without one untouched)."""
        rows = [i for i, m in enumerate(matchers) if m is not None]
        if not rows:
            return
        bitmask = self.xgr.allocate_token_bitmask(len(matchers), self.vocab_size)
        for i in rows:
            matchers[i].fill_next_token_bitmask(bitmask, i)
        self.xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=self.vocab_size, indices=rows)
