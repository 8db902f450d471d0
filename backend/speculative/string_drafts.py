"""String-level drafting (SLEM, Timor et al., ICML 2025, arXiv 2502.05202): the draft writes with its whole
vocabulary, its text is tokenized by the target's tokenizer, and the target verifies those tokens. Greedy
requests only: verification then keeps exactly the target's argmax tokens, whatever was proposed. (A sampled
request's proposal would need the probability of the target tokens under the draft, which a re-tokenized text
does not have: those draft by token-level intersection instead, vocab_bridge.py.)

Token boundaries: the draft's text is tokenized after the bytes of the target's last token, and kept only if that
token comes back whole (else the text would merge into what the target already wrote); the text stops before a
special token of the draft's and before bytes that are not yet whole UTF-8; the last target token of the text is
dropped, since the text after it could still merge with it.
"""


def target_drafts(tokenizer, target_bytes: list[bytes | None], last_target: int, draft_bytes: list[bytes | None]
                  ) -> list[int]:
    """Target token ids for the text of the draft's tokens (their bytes, in order) after the target's last token."""
    text = b""
    for b in draft_bytes:
        if b is None or b.startswith(b"\xff"):  # a special token ends the text
            break
        text += b
    last = target_bytes[last_target] if last_target < len(target_bytes) else None
    context = b"" if last is None or last.startswith(b"\xff") else last
    joined = context + text
    try:
        decoded = joined.decode()
    except UnicodeDecodeError as e:  # a character cut short (or invalid bytes): up to where it starts
        decoded = joined[:e.start].decode()
    if len(decoded.encode()) <= len(context):
        return []
    ids = tokenizer(decoded, add_special_tokens=False).input_ids
    if context:
        if not ids or ids[0] >= len(target_bytes) or target_bytes[ids[0]] != context:
            return []
        ids = ids[1:]
    return ids[:-1]
