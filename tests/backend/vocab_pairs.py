"""Draft models whose vocabularies truly differ from the tiny target's, built here (no second real model downloads):

- permuted: the target's own byte-level BPE with its ids shuffled and some merged tokens removed (with every merge
  that makes or uses them), and the target's weights re-indexed to the new ids, so that it guesses the target well
  wherever the two tokenize a text alike;
- byte fallback: a SentencePiece-style vocabulary ("▁" for spaces, <0xNN> byte tokens) trained on the same corpus,
  with random weights.
"""

import json
import random
import shutil
from pathlib import Path

import torch

from tests.backend.tiny_models import CORPUS


def build_permuted_draft(target_dir: Path, out: Path, drop: int = 40, seed: int = 0, limit: int | None = None
                         ) -> tuple[Path, dict[int, int]]:
    """(the draft's directory, target id -> draft id for the tokens it kept). limit: only ids below it move (a
    model whose vocabulary is smaller than its tokenizer's)."""
    from transformers import AutoModelForCausalLM

    spec = json.loads((target_dir / "tokenizer.json").read_text())
    vocab: dict[str, int] = spec["model"]["vocab"]
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in spec["model"]["merges"]]
    special = {t["id"] for t in spec["added_tokens"]}
    rng = random.Random(seed)
    made = ["".join(m) for m in merges]
    dropped = set(rng.sample(made, drop))
    kept_merges, gone = [], set(dropped)
    for a, b in merges:  # a merge that makes or uses a token that is gone goes too
        if a in gone or b in gone or a + b in gone:
            continue
        kept_merges.append((a, b))
    tokens = [t for t in vocab if t not in dropped]
    movable = [vocab[t] for t in tokens if vocab[t] not in special and (limit is None or vocab[t] < limit)]
    shuffled = movable[:]
    rng.shuffle(shuffled)
    mapping = {vocab[t]: vocab[t] for t in tokens} | dict(zip(movable, shuffled))
    spec["model"]["vocab"] = {t: mapping[vocab[t]] for t in tokens}
    spec["model"]["merges"] = [[a, b] for a, b in kept_merges]
    out.mkdir(parents=True, exist_ok=True)
    (out / "tokenizer.json").write_text(json.dumps(spec))
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        if (target_dir / name).exists():
            shutil.copy(target_dir / name, out / name)

    model = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32)
    with torch.no_grad():
        tables = (model.get_input_embeddings().weight, model.get_output_embeddings().weight)
        for weight in {id(w): w for w in tables}.values():  # once where the two are tied
            old = weight.clone()
            for t, d in mapping.items():
                if t < len(old):
                    weight[d] = old[t]
    model.save_pretrained(str(out))
    return out, mapping


def build_byte_fallback_draft(out: Path, vocab_size: int = 512, seed: int = 7) -> Path:
    """A random-weight llama whose tokenizer is SentencePiece-style BPE with byte fallback."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from tests.backend.tiny_models import COMMON

    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    trainer = trainers.BpeTrainer(vocab_size=250, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    spec = json.loads(tok.to_str())
    byte_tokens = {f"<0x{b:02X}>" for b in range(256)}
    for piece in sorted(byte_tokens - set(spec["model"]["vocab"])):
        spec["model"]["vocab"][piece] = len(spec["model"]["vocab"])
    tok = Tokenizer.from_str(json.dumps(spec))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    out.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(out))
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(**{**COMMON, "vocab_size": vocab_size, "pad_token_id": None})
    transformers.LlamaForCausalLM(config).eval().save_pretrained(str(out))
    return out
