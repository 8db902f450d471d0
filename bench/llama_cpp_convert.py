"""Bench files written as a user writes them: a random transformers checkpoint, llama.cpp's own converter
(convert_hf_to_gguf.py: --llama-cpp-converter PATH or LLAMA_CPP_CONVERTER, e.g. vendor/llama.cpp in the
llama-cpp-python sdist) to a bf16 GGUF, then llama.cpp's quantizer (llama_model_quantize, in llama-cpp-python's own
venv) into the mix a published file uses (Q4_K_M; MXFP4_MOE for gpt-oss). Cached under the data directory's
cache/bench like the benches' other files.

The converter names the checkpoint's pre-tokenizer by hashing the ids its tokenizer gives a fixed text and refuses
one it does not know, so a synthetic vocabulary cannot pass. The checkpoint therefore carries a real byte-level
BPE, rebuilt from a vocabulary file llama.cpp keeps beside its converter (models/ggml-vocab-<name>.gguf): GPT-2's
50,257 tokens, whose pre-tokenizer the converter names "gpt-2"; for Qwen3.5, whose tokenizer class transformers
picks by the model's type (with Qwen3.5's own splitting), the 151,936 tokens of ggml-vocab-qwen35.gguf, named
"qwen2". The model's vocabulary must hold the file's tokens (the converter pads the rest). The benches feed token
ids, so which tokenizer a file carries does not change a rate.
"""

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.cut_checkpoint import cached_gguf  # noqa: E402

# the tokens in each vocabulary file the benches use (llama.cpp's models/ggml-vocab-<name>.gguf)
VOCABULARIES = {"gpt-2": 50257, "qwen35": 151936}
# llama.cpp's llama_ftype of each mix
FTYPES = {"Q4_K_M": 15, "MXFP4_MOE": 38}
# what the benches' lines say about their file
OURS = "ours"
CONVERTED = "llama.cpp converter"


def converter_from(path: str | None) -> Path | None:
    """The converter named by path (a flag's value) or LLAMA_CPP_CONVERTER; None when neither names one."""
    path = path or os.environ.get("LLAMA_CPP_CONVERTER")
    if not path:
        return None
    converter = Path(path).resolve()
    if not converter.is_file():
        raise SystemExit(
            f"llama.cpp's converter {converter} does not exist (give convert_hf_to_gguf.py's path)"
        )
    return converter


def write_tokenizer(converter: Path, directory: Path, vocabulary: str, vocab_size: int) -> None:
    """The tokenizer of llama.cpp's models/ggml-vocab-<vocabulary>.gguf (its tokens, their kinds and its merges)
    saved into the checkpoint directory in place of any tokenizer there, with unused special tokens up to the
    model's vocab_size: the converter cuts Gemma 3's embedding to the tokens tokenizer.json lists, and llama.cpp
    wants a row for each token."""
    from gguf import GGUFReader, TokenType
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    path = converter.parent / "models" / f"ggml-vocab-{vocabulary}.gguf"
    if not path.is_file():
        raise SystemExit(
            f"{path} is missing: the converter's folder must hold llama.cpp's models/ vocabularies"
        )
    reader = GGUFReader(str(path))

    def strings(key: str) -> list[str]:
        field = reader.fields[key]
        return [bytes(field.parts[i]).decode() for i in field.data]

    tokens = strings("tokenizer.ggml.tokens")
    kinds = reader.fields["tokenizer.ggml.token_type"].contents()
    merges = [tuple(merge.split(" ", 1)) for merge in strings("tokenizer.ggml.merges")]
    tokenizer = Tokenizer(models.BPE({token: i for i, token in enumerate(tokens)}, merges))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    special = [t for t, kind in zip(tokens, kinds, strict=True) if kind == TokenType.CONTROL]
    unused = [f"<unused{i}>" for i in range(vocab_size - len(tokens))]
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=True) for t in (*special, *unused)])
    for old in directory.glob("*"):
        if old.name.startswith(("tokenizer", "special_tokens_map", "chat_template", "vocab", "merges")):
            old.unlink()
    tokenizer.save(str(directory / "tokenizer.json"))
    end = tokens[reader.fields["tokenizer.ggml.eos_token_id"].contents()]
    config = {"tokenizer_class": "GPT2TokenizerFast", "eos_token": end, "add_bos_token": False}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))


def convert(converter: Path, checkpoint: Path, out: Path, flags: tuple[str, ...] = ()) -> None:
    """llama.cpp's converter run on checkpoint with its command-line flags (by this interpreter, with the
    converter's own gguf-py first on the path), writing a bf16 GGUF to out."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(converter.parent / "gguf-py"), env.get("PYTHONPATH")) if p
    )
    command = [
        sys.executable,
        str(converter),
        str(checkpoint),
        "--outfile",
        str(out),
        "--outtype",
        "bf16",
        *flags,
    ]
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        last = (done.stderr or done.stdout).strip().splitlines()[-3:]
        raise SystemExit(f"llama.cpp's converter failed on {checkpoint}: {' / '.join(last)}")


def quantize(source: Path, out: Path, mix: str, python: str) -> None:
    """llama.cpp's quantizer (in llama-cpp-python's venv at python) writing source in the mix to out."""
    import torch
    from run_peer import run_peer  # bench/, beside this script

    job = {
        "action": "quantize",
        "source": str(source),
        "out": str(out),
        "ftype": FTYPES[mix],
        "threads": torch.get_num_threads(),
    }
    run_peer("llama_cpp_iq_peer.py", job, python)


def converted_gguf(
    name: str,
    checkpoint: Callable[[Path], None],
    mix: str,
    converter: Path,
    python: str | None,
    vocabulary: str = "gpt-2",
    flags: tuple[str, ...] = (),
) -> Path:
    """cache/bench/name: checkpoint(directory) saves a transformers checkpoint, which gets the tokenizer of one
    of llama.cpp's vocabularies (VOCABULARIES) and which llama.cpp's converter (with its command-line flags) and
    quantizer turn into the mix (written on first use)."""
    if not python:
        raise SystemExit(
            "llama.cpp's quantizer runs in llama-cpp-python's venv: give --llama-cpp-python or LLAMA_CPP_PYTHON"
        )

    def write(scratch: Path, partial: Path) -> None:
        hf, bf16 = scratch / "hf", scratch / "bf16.gguf"
        checkpoint(hf)
        write_tokenizer(converter, hf, vocabulary, json.loads((hf / "config.json").read_text())["vocab_size"])
        convert(converter, hf, bf16, flags)
        shutil.rmtree(hf)  # the checkpoint and the bf16 file are each several GB at the benches' shapes
        quantize(bf16, partial, mix, python)

    return cached_gguf(name, write)
