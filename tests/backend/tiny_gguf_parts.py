"""What every tiny GGUF writer of the tests (tiny_gguf*.py) writes alike: the widths' keys, a gpt2 tokenizer as
convert_hf_to_gguf.py writes one, and the file's close with the reference checkpoint beside it."""

import json
from pathlib import Path

import torch
from gguf import GGUFWriter
from safetensors.torch import save_file


def add_widths(w: GGUFWriter, cfg: dict) -> None:
    """The keys every layout writes alike from config.json."""
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_vocab_size(cfg["vocab_size"])


def add_tokenizer(w: GGUFWriter, cfg: dict, hf_dir: Path) -> None:
    """The checkpoint's byte-level BPE tokenizer as the converter writes a gpt2 one: the token list padded to
    the vocabulary, the merges, bos and eos, and the chat template."""
    tok = json.loads((hf_dir / "tokenizer.json").read_text())
    tokens = [t for t, _ in sorted(tok["model"]["vocab"].items(), key=lambda kv: kv[1])]
    special = {a["content"] for a in tok["added_tokens"]}
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens + [f"[PAD{i}]" for i in range(len(tokens), cfg["vocab_size"])])
    w.add_token_types([3 if t in special else 1 for t in tokens] + [4] * (cfg["vocab_size"] - len(tokens)))
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]])
    w.add_bos_token_id(cfg["bos_token_id"])
    w.add_eos_token_id(cfg["eos_token_id"])
    w.add_chat_template(
        json.loads((hf_dir / "tokenizer_config.json").read_text()).get("chat_template")
        or (hf_dir / "chat_template.jinja").read_text()
    )


def close(writer: GGUFWriter) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def write_reference(
    out: Path, hf_dir: Path, ref: dict[str, torch.Tensor], config: dict | None = None
) -> Path:
    """out.reference: hf_dir's files with the weights ref holds (as the GGUF file decodes), and config in place
    of its config.json where given."""
    ref_dir = out.with_suffix(".reference")
    ref_dir.mkdir(exist_ok=True)
    for f in hf_dir.iterdir():
        if f.name != "model.safetensors" and f.is_file():
            (ref_dir / f.name).write_bytes(f.read_bytes())
    if config is not None:
        (ref_dir / "config.json").write_text(json.dumps(config))
    save_file(
        {k: v.contiguous() for k, v in ref.items()},
        str(ref_dir / "model.safetensors"),
        metadata={"format": "pt"},
    )
    return ref_dir
