"""A GGUF whose vocabulary is another's with the ids of its ordinary tokens shuffled, and the token-embedding rows
(quantized blocks moved whole, so exactly the same numbers) moved with them: a draft that predicts exactly what
the original predicts, through a vocabulary of other ids. bench/speculative.py measures what drafting across
vocabularies (token-level intersection) costs with it, beside the same weights drafting with the same ids."""

import random
from pathlib import Path

import numpy as np
from gguf import GGUFReader, GGUFValueType, GGUFWriter

NORMAL = 1  # tokenizer.ggml.token_type of an ordinary token (control, byte and user-defined tokens stay put)


def _value(field):
    return field.contents()


def shuffle_vocab(source: Path, out: Path, seed: int = 0) -> Path:
    """Write `out` from `source` with its ordinary tokens' ids shuffled; returns `out`."""
    reader = GGUFReader(str(source))
    tokens = _value(reader.fields["tokenizer.ggml.tokens"])
    types = _value(reader.fields["tokenizer.ggml.token_type"])
    movable = [i for i, t in enumerate(types) if t == NORMAL]
    shuffled = movable[:]
    random.Random(seed).shuffle(shuffled)
    new_id = list(range(len(tokens)))
    for old, new in zip(movable, shuffled):
        new_id[old] = new
    order = [0] * len(tokens)  # new id -> old id
    for old, new in enumerate(new_id):
        order[new] = old

    arch = _value(reader.fields["general.architecture"])
    writer = GGUFWriter(str(out), arch)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        value = _value(field)
        if name in ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.scores"):
            value = [value[old] for old in order]
        elif name.startswith("tokenizer.ggml.") and name.endswith("_token_id"):
            value = new_id[value]
        vtype = field.types[0]
        sub = field.types[-1] if vtype == GGUFValueType.ARRAY else None
        writer.add_key_value(name, value, vtype, sub_type=sub)
    for tensor in reader.tensors:
        data = np.asarray(tensor.data)
        if tensor.name in ("token_embd.weight", "output.weight"):
            data = np.ascontiguousarray(data[order])
        writer.add_tensor(tensor.name, data, raw_dtype=tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out
