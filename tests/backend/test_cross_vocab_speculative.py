"""A draft with another vocabulary (token-level intersection): greedy output identical to the target alone, on
texts with multi-byte UTF-8 and code, with a draft that is the target's weights under a shuffled and trimmed
vocabulary and with a SentencePiece-style byte-fallback draft; the bytes bookkeeping that keeps the draft reading
the target's text; what `auto` chooses; and the refusals when no method applies. (The sampled distribution is
checked in test_speculative.py, with a shuffled-vocabulary draft beside the shared one.)"""

import json

import pytest

from backend import LLM, SamplingParams
from backend.model_config import ModelLoadError
from backend.spec.vocab_bridge import VocabBridge, token_bytes
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


@pytest.mark.parametrize("name", ["shuffled", "permuted", "byte_fallback"])
def test_greedy_output_is_the_targets_with_a_draft_of_another_vocabulary(drafts, name):
    target = str(drafts["target"])
    prompts = TEXTS + prompts_of_lengths(9, 33)
    expected = [o.outputs[0].token_ids for o in LLM(target, block_size=8).generate(prompts, GREEDY, use_tqdm=False)]
    llm = LLM(target, block_size=8, speculative={"method": "draft", "model": str(drafts[name]), "num_tokens": 3,
                                                 "max_batch_size": 64})
    assert llm.engine.vocab_bridge is not None  # auto chose the intersection
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    stats = llm.engine.stats()
    assert stats["spec_draft_tokens"] > 0
    if name == "shuffled":  # the target's own weights under other ids: every draft is the target's choice
        assert stats["spec_accepted_tokens"] == stats["spec_draft_tokens"], stats
    engine = llm.engine
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert engine.proposer.block_manager.num_free_blocks == engine.proposer.block_manager.num_blocks


def test_which_drafts_are_refused_and_why(drafts, tmp_path):
    target = str(drafts["target"])
    with pytest.raises(ModelLoadError, match="use vocab 'intersection' or 'auto'"):
        LLM(target, speculative={"method": "draft", "model": str(drafts["permuted"]), "vocab": "shared"})
    with pytest.raises(ValueError, match="speculative vocab 'string' is not supported"):
        LLM(target, speculative={"method": "draft", "model": str(drafts["permuted"]), "vocab": "string"})
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
