"""A draft model with another vocabulary than the target's: token-level intersection (TLI, Timor et al., ICML
2025, arXiv 2502.05202).

Each token of either vocabulary stands for a string of bytes (byte-level BPE maps bytes to printable characters;
SentencePiece writes a space as "▁" and unknown bytes as "<0xNN>"; special tokens stand for their own text). A
draft token whose bytes are exactly one target token's is that token's twin. The draft proposes only twins: its
distribution, moved onto the target's ids with every other token at zero, is an ordinary proposal q for the
rejection sampler, which keeps the target's distribution whatever q is (greedy requests: the target's argmax).

Invariant of the draft's own token list: its bytes are the bytes of the target's tokens so far (special tokens
without a twin left out). A target token with a twin becomes that twin; one without becomes the longest draft
tokens that spell its bytes. So the draft reads the text the target wrote, tokenized its own way, and a token the
target accepted from the draft keeps the draft's own id (and its KV) there.
"""

import json
import logging
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)

VOCAB_METHODS = ("auto", "shared", "intersection", "string")
# auto: intersection when at least this share of the draft's tokens has a twin; below it the draft could propose
# too little of what it predicts, and greedy requests draft by string (string_drafts.py)
MIN_TWIN_SHARE = 0.5


def _byte_level_chars() -> dict[str, int]:
    """The printable character byte-level BPE writes for each byte: printable Latin-1 bytes stand for themselves,
    the others for 256, 257, ... in byte order."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


def token_bytes(tokenizer, vocab_size: int) -> list[bytes | None]:
    """The bytes each id stands for (None: no such token); special tokens as their text, marked by a 0xff prefix
    (never valid UTF-8), so that they only ever match another vocabulary's identical special token."""
    spec = json.loads(tokenizer.backend_tokenizer.to_str())
    decoder = json.dumps(spec.get("decoder") or {})
    byte_level = '"ByteLevel"' in decoder
    if not byte_level and "▁" not in decoder and '"ByteFallback"' not in decoder:
        raise ValueError(f"cannot tell which bytes the tokens of {type(tokenizer).__name__} stand for (its decoder is "
                         "neither byte-level BPE nor SentencePiece-style)")
    chars = _byte_level_chars()
    special = set(tokenizer.all_special_ids) | {t["id"] for t in spec.get("added_tokens") or [] if t.get("special")}
    out: list[bytes | None] = [None] * vocab_size
    for piece, tid in tokenizer.get_vocab().items():  # ids need not be dense (a vocabulary with tokens removed)
        if tid >= vocab_size:
            continue
        if tid in special:
            out[tid] = b"\xff" + piece.encode()
        elif byte_level:
            if all(c in chars for c in piece):
                out[tid] = bytes(chars[c] for c in piece)
            else:  # an added token written as plain text
                out[tid] = piece.encode()
        elif len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            out[tid] = bytes([int(piece[3:5], 16)])
        else:
            out[tid] = piece.replace("▁", " ").encode()
    return out


@dataclass
class VocabBridge:
    """Between a draft's vocabulary and the target's, through the bytes their tokens stand for."""

    twin_draft_ids: torch.Tensor  # draft ids that have a twin in the target's vocabulary
    twin_target_ids: torch.Tensor  # their twins, in the same order
    to_draft: dict[int, int]  # target id -> its twin's draft id
    spell: dict[bytes, int]  # bytes -> a draft id, to spell a target token that has no twin
    target_bytes: list[bytes | None]
    longest: int  # the most bytes one draft token stands for
    target_vocab: int
    twin_share: float  # of the draft's tokens
    draft_bytes: list[bytes | None]
    target_tokenizer: object
    by_string: bool = False  # greedy requests draft by string-level matching (string_drafts.py)

    @classmethod
    def build(cls, target_tokenizer, target_vocab: int, draft_tokenizer, draft_vocab: int) -> "VocabBridge":
        target = token_bytes(target_tokenizer, target_vocab)
        draft = token_bytes(draft_tokenizer, draft_vocab)
        by_bytes: dict[bytes, int] = {}
        for tid, b in enumerate(target):
            if b is not None:
                by_bytes.setdefault(b, tid)
        spell: dict[bytes, int] = {}
        to_draft: dict[int, int] = {}
        for did, b in enumerate(draft):
            if b is None:
                continue
            spell.setdefault(b, did)
            tid = by_bytes.get(b)
            if tid is not None and tid not in to_draft:
                to_draft[tid] = did
        pairs = sorted((d, t) for t, d in to_draft.items())
        usable = sum(b is not None for b in draft)
        return cls(torch.tensor([d for d, _ in pairs], dtype=torch.long), torch.tensor([t for _, t in pairs],
                                                                                         dtype=torch.long),
                   to_draft, spell, target, max((len(b) for b in spell), default=1), target_vocab,
                   len(pairs) / max(usable, 1), draft, target_tokenizer)

    @property
    def identical(self) -> bool:
        """Every target token is its own twin: the vocabularies are one."""
        return len(self.to_draft) == sum(b is not None for b in self.target_bytes) and all(
            t == d for t, d in self.to_draft.items())

    def target_logits(self, draft_logits: torch.Tensor) -> torch.Tensor:
        """[N, draft vocab] -> [N, target vocab]: each twin's logit at its target id, -inf elsewhere."""
        out = torch.full((draft_logits.shape[0], self.target_vocab), float("-inf"), dtype=draft_logits.dtype,
                         device=draft_logits.device)
        if self.twin_target_ids.device != draft_logits.device:  # moved once, not every draft step
            self.twin_target_ids = self.twin_target_ids.to(draft_logits.device)
            self.twin_draft_ids = self.twin_draft_ids.to(draft_logits.device)
        out[:, self.twin_target_ids] = draft_logits[:, self.twin_draft_ids]
        return out

    def draft_tokens(self, target_ids: list[int]) -> list[int]:
        """The draft's tokens for these target tokens (module docstring); a special token without a twin gives
        none. ValueError when the draft's vocabulary cannot spell a token's bytes."""
        out: list[int] = []
        for tid in target_ids:
            twin = self.to_draft.get(tid)
            if twin is not None:
                out.append(twin)
                continue
            b = self.target_bytes[tid] if tid < len(self.target_bytes) else None
            if b is None or b.startswith(b"\xff"):
                continue
            i = 0
            while i < len(b):
                for n in range(min(self.longest, len(b) - i), 0, -1):
                    did = self.spell.get(b[i:i + n])
                    if did is not None:
                        out.append(did)
                        i += n
                        break
                else:
                    raise ValueError(f"the draft's vocabulary cannot spell byte {b[i]:#04x}")
        return out


def choose_vocab(method: str, target_tokenizer, target_vocab: int, draft_tokenizer, draft_vocab: int,
                 draft_name: str) -> VocabBridge | None:
    """The bridge a draft needs (None: it shares the target's vocabulary), by `method` (VOCAB_METHODS); raises
    ValueError saying why a draft cannot be used."""
    if method not in VOCAB_METHODS:
        raise ValueError(f"speculative vocab {method!r} is not supported; use one of {', '.join(VOCAB_METHODS)}")
    if target_tokenizer is None or draft_tokenizer is None:
        if draft_vocab != target_vocab or method in ("intersection", "string"):
            raise ValueError(f"draft model {draft_name} has a vocabulary of {draft_vocab} tokens but the target has "
                             f"{target_vocab}; a draft with another vocabulary needs a tokenizer, and so does the "
                             "target (token ids alone cannot be matched)")
        return None
    bridge = VocabBridge.build(target_tokenizer, target_vocab, draft_tokenizer, draft_vocab)
    same = bridge.identical and draft_vocab == target_vocab
    if method == "shared":
        if not same:
            raise ValueError(f"draft model {draft_name} has another vocabulary than the target ({draft_vocab} tokens "
                             f"against {target_vocab}, {len(bridge.to_draft)} shared); use vocab 'intersection' or "
                             "'auto' to draft across vocabularies")
        return None
    if same:
        log.info("speculative draft %s shares the target's vocabulary", draft_name)
        return None
    share = bridge.twin_share
    bridge.by_string = method == "string" or (method == "auto" and share < MIN_TWIN_SHARE)
    if bridge.by_string and not bridge.to_draft:
        log.warning("speculative draft %s shares no token with the target: sampled requests are not speculated",
                    draft_name)
    log.info("speculative draft %s: %d of its tokens (%.0f%%) have a twin among the target's %d; drafting by %s "
             "(%s)", draft_name, len(bridge.to_draft), 100 * share, target_vocab,
             "string-level matching for greedy requests, token-level intersection for sampled ones"
             if bridge.by_string else "token-level intersection",
             "chosen" if method != "auto" else "auto: the vocabularies differ"
             + (f", fewer than {MIN_TWIN_SHARE:.0%} of its tokens are the target's" if bridge.by_string else ""))
    return bridge
