"""A GGUF model's tokenizer read straight from the files its first start converted (tokenizer.json,
tokenizer_config.json, chat_template.jinja) with the `tokenizers` library and jinja2: the part of
transformers' tokenizer API the stack and its users call, in ~0.1 s instead of the ~1.2 s that importing
transformers' tokenizer classes costs every start.

tokenizer.json is used as written. transformers, loading the same directory, rebuilds some families'
pre-tokenizers in code (Qwen2's splits digits one by one), so a file's second start would tokenize unlike
its first; here every start tokenizes as the conversion did. Checked against transformers in
tests/backend/test_plain_tokenizer.py.
"""

import json
from dataclasses import dataclass, field
from pathlib import Path

from tokenizers import Tokenizer

from backend.chat_template import render as render_chat

NAMED_SPECIAL = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# apply_chat_template's options of transformers this tokenizer does not have: refused by name, never handed to the
# template as variables
NOT_HERE = ("continue_final_message", "return_assistant_tokens_mask", "return_tensors", "padding", "truncation",
            "max_length", "tokenizer_kwargs", "sanitize_control_tokens")


@dataclass
class Encoding:
    """What calling a tokenizer returns: the ids, as transformers' BatchEncoding gives them."""
    input_ids: list[int] | list[list[int]]  # a list of lists for a batch of texts
    attention_mask: list[int] | list[list[int]] = field(default_factory=list)

    def __getitem__(self, key: str):
        return getattr(self, key)

    def keys(self) -> list[str]:
        return ["input_ids", "attention_mask"]


def _token_text(value) -> str | None:
    return value.get("content") if isinstance(value, dict) else value


class PlainTokenizer:
    is_fast = True

    def __init__(self, directory: Path):
        directory = Path(directory)
        self.name_or_path = str(directory)
        self.backend_tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
        config_file = directory / "tokenizer_config.json"
        config = json.loads(config_file.read_text()) if config_file.exists() else {}
        template_file = directory / "chat_template.jinja"
        self.chat_template: str | None = template_file.read_text() if template_file.exists() \
            else config.get("chat_template")
        self.special_tokens_map = {name: _token_text(config[name]) for name in NAMED_SPECIAL
                                   if _token_text(config.get(name)) is not None}
        extra = config.get("extra_special_tokens", config.get("additional_special_tokens")) or []
        if isinstance(extra, dict):  # model-specific named tokens (image_token, ...)
            self.special_tokens_map.update({k: _token_text(v) for k, v in extra.items()})
            extra = []
        names = list(self.special_tokens_map.values()) + [_token_text(t) for t in extra]
        self.all_special_tokens = list(dict.fromkeys(names))
        self.all_special_ids = [self.convert_tokens_to_ids(t) for t in self.all_special_tokens]
        self.model_max_length = config.get("model_max_length", 1 << 60)
        self.add_bos_token = self.bos_token_id is not None and \
            self.backend_tokenizer.encode("", add_special_tokens=True).ids[:1] == [self.bos_token_id]

    def __getattr__(self, name: str):
        # bos_token, eos_token_id, pad_token, ...: the named special tokens and their ids (None when unset)
        base, is_id = (name[:-3], True) if name.endswith("_id") else (name, False)
        if base not in NAMED_SPECIAL:
            raise AttributeError(name)
        text = self.__dict__.get("special_tokens_map", {}).get(base)
        if is_id:
            return None if text is None else self.convert_tokens_to_ids(text)
        return text

    def __len__(self) -> int:
        return self.backend_tokenizer.get_vocab_size(with_added_tokens=True)

    @property
    def vocab_size(self) -> int:
        return self.backend_tokenizer.get_vocab_size(with_added_tokens=False)

    def get_vocab(self) -> dict[str, int]:
        return self.backend_tokenizer.get_vocab(with_added_tokens=True)

    @property
    def vocab(self) -> dict[str, int]:
        return self.get_vocab()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend_tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def __call__(self, text: str | list[str], add_special_tokens: bool = True) -> Encoding:
        if isinstance(text, str):
            ids = self.encode(text, add_special_tokens)
            return Encoding(ids, [1] * len(ids))
        batch = [e.ids for e in self.backend_tokenizer.encode_batch(list(text), add_special_tokens=add_special_tokens)]
        return Encoding(batch, [[1] * len(ids) for ids in batch])

    def tokenize(self, text: str, add_special_tokens: bool = False) -> list[str]:
        return self.backend_tokenizer.encode(text, add_special_tokens=add_special_tokens).tokens

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        ids = ids.tolist() if hasattr(ids, "tolist") else ids  # a tensor or an array, as transformers takes them
        return self.backend_tokenizer.decode([ids] if isinstance(ids, int) else list(ids),
                                             skip_special_tokens=skip_special_tokens)

    def batch_decode(self, sequences: list[list[int]], skip_special_tokens: bool = False) -> list[str]:
        return [self.decode(ids, skip_special_tokens) for ids in sequences]

    def convert_tokens_to_ids(self, tokens: str | list[str]):
        if isinstance(tokens, str):
            tid = self.backend_tokenizer.token_to_id(tokens)
            unk = self.special_tokens_map.get("unk_token")
            return tid if tid is not None or unk is None else self.backend_tokenizer.token_to_id(unk)
        return [self.convert_tokens_to_ids(t) for t in tokens]

    def convert_ids_to_tokens(self, ids: int | list[int]):
        if isinstance(ids, int):
            return self.backend_tokenizer.id_to_token(ids)
        return [self.backend_tokenizer.id_to_token(i) for i in ids]

    def apply_chat_template(self, conversation: list, tools: list[dict] | None = None, documents=None,
                            chat_template: str | None = None, add_generation_prompt: bool = False,
                            tokenize: bool = True, return_dict: bool = True, **kwargs):
        """transformers' apply_chat_template for one conversation: the text (tokenize=False), else its ids
        without added special tokens (the template writes them), as an Encoding (return_dict) or a list."""
        refused = [name for name in NOT_HERE if kwargs.pop(name, None)]
        if refused:
            raise NotImplementedError(f"apply_chat_template({refused[0]}=...) is transformers' own: load this directory "
                                      f"with transformers.AutoTokenizer.from_pretrained({self.name_or_path!r}) for it")
        if not conversation:
            raise ValueError("the conversation is empty: give at least one message")
        template = chat_template or self.chat_template
        if template is None:
            raise ValueError("this tokenizer has no chat template: pass chat_template=...")
        text = render_chat(template, conversation, tools=tools, documents=documents,
                           add_generation_prompt=add_generation_prompt, **{**self.special_tokens_map, **kwargs})
        if not tokenize:
            return text
        encoded = self(text, add_special_tokens=False)
        return encoded if return_dict else encoded.input_ids

