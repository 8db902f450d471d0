"""A grammar held after the think block (backend/engine/guided_reasoning.py), against xgrammar's own matcher of the
same grammar: while the block is open every token may come; before the output begins, the block's opening as well
as what the grammar allows; after `</think>`, exactly what the plain grammar allows."""

import pytest
import torch

from backend.engine.guided import GuidedDecoding
from backend.engine.guided_reasoning import think_first
from tests.backend.tiny_models import build_model

xgrammar = pytest.importorskip("xgrammar")


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    model = build_model("qwen3", tmp_path_factory.mktemp("think") / "tiny-think")
    tok = AutoTokenizer.from_pretrained(str(model))
    tok.add_tokens(["<think>", "</think>"])
    return tok


def allowed(matcher, vocab: int) -> set[int]:
    mask = xgrammar.allocate_token_bitmask(1, vocab)
    matcher.fill_next_token_bitmask(mask, 0)
    logits = torch.zeros(1, vocab)
    xgrammar.apply_token_bitmask_inplace(logits, mask, vocab_size=vocab)
    return set(torch.nonzero(~torch.isneginf(logits[0])).flatten().tolist())


def test_the_grammar_holds_after_the_think_block_alone(tokenizer):
    vocab = len(tokenizer)
    guided = GuidedDecoding(tokenizer, vocab)
    open_id, close_id = (tokenizer.convert_tokens_to_ids(t) for t in ("<think>", "</think>"))
    b, brace, end = (tokenizer.encode(t, add_special_tokens=False)[0] for t in (" b", "{", "}"))
    plain = guided.matcher(True)
    first = allowed(plain, vocab)
    assert b not in first and brace in first and open_id not in first

    m = think_first(guided.matcher(True), open_id, close_id, opened=False)
    assert allowed(m, vocab) == first | {open_id}  # the block may still open
    assert m.accept_token(open_id) and m.state == "thinking"
    everything = set(range(vocab))
    for token in (b, brace, b, end):  # inside the block nothing is held, braces included
        assert allowed(m, vocab) == everything
        assert m.accept_token(token) and not m.is_terminated()
    assert m.accept_token(close_id)
    assert allowed(m, vocab) == first
    assert not m.accept_token(b)  # the answer is the grammar's: " b" is no JSON
    for token in (brace, end):
        assert m.accept_token(token) and plain.accept_token(token)
        assert allowed(m, vocab) == allowed(plain, vocab)
    assert m.is_terminated() == plain.is_terminated()

    opened = think_first(guided.matcher(True), open_id, close_id, opened=True)  # the prompt opened the block
    assert allowed(opened, vocab) == everything and opened.accept_token(close_id) and allowed(opened, vocab) == first
    direct = think_first(guided.matcher(True), open_id, close_id, opened=False)
    assert direct.accept_token(brace) and direct.state == "answer"  # no block: the grammar from the first token
    assert not direct.accept_token(open_id)


def test_the_open_marker_in_the_sign_bit_of_its_word(tokenizer):
    """A marker id at bit 31 of a 32-bit word is set through the sign, not overflowed."""
    vocab = len(tokenizer)
    guided = GuidedDecoding(tokenizer, vocab)
    first = allowed(guided.matcher(True), vocab)
    marker = next(32 * w + 31 for w in range(vocab // 32) if 32 * w + 31 not in first)
    m = think_first(guided.matcher(True), marker, 0, opened=False)
    assert allowed(m, vocab) == first | {marker}
