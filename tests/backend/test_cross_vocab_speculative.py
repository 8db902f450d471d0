"""A draft with another vocabulary (token-level intersection): greedy output identical to the target alone, on
texts with multi-byte UTF-8 and code, with a draft that is the target's weights under a shuffled and trimmed
vocabulary and with a SentencePiece-style byte-fallback draft; the bytes bookkeeping that keeps the draft reading
the target's text; what `auto` chooses; and the refusals when no method applies. (The sampled distribution is
checked in test_speculative.py, with a shuffled-vocabulary draft beside the shared one.)"""

import json

import pytest

from backend import LLM, SamplingParams
from backend.model_config import ModelLoadError
from backend.speculative.string_drafts import target_drafts
from backend.speculative.vocab_bridge import VocabBridge, token_bytes
from tests.backend.conftest import prompts_of_lengths
from tests.backend.tiny_models import build_model
from tests.backend.vocab_pairs import build_byte_fallback_draft, build_permuted_draft

TEXTS = ["The scribe copied the manuscript by candlelight", "naïve café, 東京 ≠ 😀 — «quoted»",
         "def f(x):\n    return x * 2  # ✓ {ok}", "Paged attention keeps the cache in blocks; prefix"]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def drafts(tmp_path_factory):
    root = tmp_path_factory.mktemp("drafts")
    # every id of the target's is a token of its tokenizer's (400), so each one it writes is text the draft can read
    target = build_model("llama", root / "target", vocab_size=400)
    shuffled, _ = build_permuted_draft(target, root / "shuffled", drop=0)
    permuted, _ = build_permuted_draft(target, root / "permuted", drop=10)
    return {"target": target, "shuffled": shuffled, "permuted": permuted,
            "byte_fallback": build_byte_fallback_draft(root / "fallback")}


def _tokenizer(path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


def test_a_draft_reads_the_targets_text_byte_for_byte(drafts):
    target = _tokenizer(drafts["target"])
    for name in ("permuted", "byte_fallback"):
        draft = _tokenizer(drafts[name])
        bridge = VocabBridge.build(target, 400, draft, 512)
        target_bytes, draft_bytes = token_bytes(target, 400), token_bytes(draft, 512)
        assert not bridge.identical and bridge.twin_share > 0.5, (name, bridge.twin_share)
        for text in TEXTS:
            ids = target(text).input_ids
            spelled = bridge.draft_tokens(ids)
            assert b"".join(draft_bytes[d] for d in spelled) == b"".join(target_bytes[t] for t in ids) \
                == text.encode(), (name, text)
        for t, d in bridge.to_draft.items():  # twins stand for the same bytes
            assert target_bytes[t] == draft_bytes[d]
    fallback = token_bytes(_tokenizer(drafts["byte_fallback"]), 512)
    assert bytes([0xE6]) in fallback and b" the" in fallback  # <0xE6> and "▁the"


@pytest.mark.parametrize("name,vocab", [("shuffled", "auto"), ("permuted", "auto"), ("byte_fallback", "auto"),
                                        ("shuffled", "string"), ("byte_fallback", "string")])
def test_greedy_output_is_the_targets_with_a_draft_of_another_vocabulary(drafts, name, vocab):
    target = str(drafts["target"])
    prompts = TEXTS + prompts_of_lengths(9, 33)
    expected = [o.outputs[0].token_ids for o in LLM(target, block_size=8).generate(prompts, GREEDY, use_tqdm=False)]
    llm = LLM(target, block_size=8, speculative={"method": "draft", "model": str(drafts[name]), "num_tokens": 3,
                                                 "max_batch_size": 64, "vocab": vocab})
    bridge = llm.engine.vocab_bridge
    assert bridge is not None and bridge.by_string == (vocab == "string")  # auto chose the intersection
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    stats = llm.engine.stats()
    assert stats["spec_draft_tokens"] > 0
    if name == "shuffled" and vocab == "auto":  # the target's weights under other ids: every draft is its choice
        assert stats["spec_accepted_tokens"] == stats["spec_draft_tokens"], stats
    elif name == "shuffled":  # its text, tokenized again by the target: mostly the target's own tokens
        assert stats["spec_accepted_tokens"] > stats["spec_draft_tokens"] / 2, stats
    engine = llm.engine
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert engine.proposer.block_manager.num_free_blocks == engine.proposer.block_manager.num_blocks


def test_string_drafts_keep_to_token_boundaries(drafts):
    target = _tokenizer(drafts["target"])
    table = token_bytes(target, 400)

    def ids(text: str) -> list[int]:
        return target(text, add_special_tokens=False).input_ids

    last = ids("The")[-1]
    drafts_of = lambda *pieces: target_drafts(target, table, last, list(pieces))  # noqa: E731
    whole = drafts_of(b" scribe", b" copied", b" the")
    assert whole == ids("The scribe copied the")[1:-1]  # the last token could still grow: left out
    # a character cut short stops the text before it; a special token ends it
    assert drafts_of(b" caf", b"\xc3", b" x") == ids("The caf")[1:-1]
    assert drafts_of(b" scribe", b" copied", b"\xff</s>", b" more") == ids("The scribe copied")[1:-1]
    # text that would merge into the target's last token is not proposed
    assert drafts_of(b"re") == [] or ids("There")[0] == last


def test_auto_drafts_by_string_when_few_tokens_are_shared(drafts, monkeypatch):
    import backend.speculative.vocab_bridge as vb

    target, draft = _tokenizer(drafts["target"]), _tokenizer(drafts["byte_fallback"])
    assert not vb.choose_vocab("auto", target, 400, draft, 512, "fallback").by_string
    monkeypatch.setattr(vb, "MIN_TWIN_SHARE", 1.01)  # as if fewer than half its tokens were the target's
    assert vb.choose_vocab("auto", target, 400, draft, 512, "fallback").by_string


def test_which_drafts_are_refused_and_why(drafts, tmp_path):
    target = str(drafts["target"])
    with pytest.raises(ModelLoadError, match="use vocab 'intersection' or 'auto'"):
        LLM(target, speculative={"method": "draft", "model": str(drafts["permuted"]), "vocab": "shared"})
    with pytest.raises(ValueError, match="speculative vocab 'slem' is not supported"):
        LLM(target, speculative={"method": "draft", "model": str(drafts["permuted"]), "vocab": "slem"})
    # A vocabulary whose tokens' bytes cannot be told (a word-level tokenizer without a decoder)
    words = tmp_path / "words"
    words.mkdir()
    for name in ("config.json", "model.safetensors", "generation_config.json"):
        if (drafts["permuted"] / name).exists():
            (words / name).write_bytes((drafts["permuted"] / name).read_bytes())
    (words / "tokenizer.json").write_text(json.dumps({
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": [], "normalizer": None,
        "pre_tokenizer": {"type": "Whitespace"}, "post_processor": None, "decoder": None,
        "model": {"type": "WordLevel", "vocab": {"[UNK]": 0, "scribe": 1, "ink": 2}, "unk_token": "[UNK]"}}))
    (words / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))
    with pytest.raises(ModelLoadError, match="cannot tell which bytes the tokens"):
        LLM(target, speculative={"method": "draft", "model": str(words)})
