"""How long a sequence an engine serves, and the RoPE scaling that takes (YaRN past the trained length).

The setting (EngineConfig.rope_scaling) is None (the model file's own scaling), "none" (no scaling, even where
the file has some) or a dict such as {"rope_type": "yarn", "factor": 4}. Static YaRN changes the model's outputs
at every position, so it is switched on automatically only when max_model_len is asked past the trained length.
"""

import json
import logging
import math
from dataclasses import replace

from backend.config import EngineConfig
from backend.model_config import ModelConfig

log = logging.getLogger(__name__)

DEFAULT_CAP = 8192  # max_model_len=None: the model's context, at most this (a 128k model's cache is sized for it)
DEFAULT_YARN_FACTOR = 4  # "yarn" with neither a factor nor a max_model_len
SETTABLE = ("yarn", "linear")


def parse_rope_scaling(text: str) -> dict | str:
    """--rope-scaling: none, yarn, yarn:FACTOR, linear:FACTOR, or JSON such as {"rope_type":"yarn","factor":4}."""
    text = text.strip()
    if text.lower() == "none":
        return "none"
    if text.startswith("{"):
        try:
            value = json.loads(text)
        except ValueError as e:
            raise ValueError(f"--rope-scaling {text!r} is not valid JSON ({e})") from None
    else:
        kind, _, factor = text.partition(":")
        value = {"rope_type": kind}
        if factor:
            try:
                value["factor"] = float(factor)
            except ValueError:
                raise ValueError(f"--rope-scaling {text!r}: the factor after ':' must be a number") from None
    return check_rope_scaling(value)


def check_rope_scaling(value) -> dict | str | None:
    """A setting as EngineConfig takes it, with a message naming what is accepted when it is not one."""
    if value is None or value == "none":
        return value
    if isinstance(value, str):
        return parse_rope_scaling(value)
    if not isinstance(value, dict):
        raise ValueError(f"rope_scaling must be 'none', a string such as 'yarn:4' or a dict, got {value!r}")
    value = dict(value)
    kind = value.pop("type", None) or value.get("rope_type")
    if kind not in SETTABLE:
        raise ValueError(f"rope_scaling type {kind!r} is not supported; use none, yarn (yarn:FACTOR) or "
                         "linear:FACTOR")
    value["rope_type"] = kind
    factor = value.get("factor")
    if factor is None and kind == "linear":
        raise ValueError("rope_scaling linear needs a factor, e.g. linear:2")
    if factor is not None and (isinstance(factor, bool) or not isinstance(factor, (int, float)) or factor < 1):
        raise ValueError(f"rope_scaling factor must be a number >= 1, got {factor!r}")
    return value


def trained_length(cfg: ModelConfig) -> int:
    """The context the model was trained at, before any scaling of its own file."""
    scaling = cfg.rope_scaling or {}
    return int(scaling.get("original_max_position_embeddings") or cfg.max_position_embeddings)


def _context(cfg: ModelConfig, scaling: dict | None, trained: int) -> int:
    """The longest sequence a model serves under `scaling`."""
    if scaling is not None and scaling["rope_type"] == "yarn":
        return int(scaling["original_max_position_embeddings"] * scaling["factor"])
    if scaling is not None and scaling["rope_type"] == "linear" and "original_max_position_embeddings" in scaling:
        return int(trained * scaling["factor"])
    return cfg.max_position_embeddings


def fit_context(cfg: ModelConfig, setting, max_model_len: int | None) -> tuple[ModelConfig, int]:
    """The model's config with the RoPE scaling it runs under, and the max_model_len the engine serves."""
    setting = check_rope_scaling(setting)
    trained = trained_length(cfg)
    if setting == "none":
        scaling = None
    elif setting is None:
        scaling = cfg.rope_scaling
        if max_model_len is not None and max_model_len > _context(cfg, scaling, trained) and (
                scaling is None or scaling["rope_type"] == "yarn"):
            factor = math.ceil(max_model_len / trained)
            log.info("max_model_len=%d is past the model's trained length of %d tokens: RoPE scaled by YaRN, "
                     "factor %d (rope_scaling sets it otherwise)", max_model_len, trained, factor)
            scaling = {**(scaling or {}), "rope_type": "yarn", "factor": float(factor),
                       "original_max_position_embeddings": trained}
    else:
        factor = setting.get("factor")
        if factor is None:  # only yarn may leave it out: enough for max_model_len
            factor = math.ceil(max_model_len / trained) if max_model_len else DEFAULT_YARN_FACTOR
        scaling = {**setting, "factor": float(max(factor, 1)),
                   "original_max_position_embeddings": setting.get("original_max_position_embeddings", trained)}
    context = _context(cfg, scaling, trained)
    if max_model_len is None:
        # An explicit scaling is asked for its length; a file's own is capped like any model's context.
        max_model_len = context if isinstance(setting, dict) else min(context, DEFAULT_CAP)
    elif max_model_len > context:
        hint = "raise its factor" if scaling is not None else "pass rope_scaling yarn (--rope-scaling yarn)"
        raise ValueError(f"max_model_len={max_model_len} is past the {context} tokens {cfg.architecture} serves "
                         f"with rope_scaling {_describe(scaling)} (trained at {trained}); {hint} or lower "
                         "max_model_len")
    if scaling is not None and scaling["rope_type"] == "longrope":
        # One set of LongRoPE factors for the engine's life, as llama.cpp picks them by its context size: the long
        # ones where a sequence may run past the trained length. transformers switches by each pass's sequence
        # length, which agrees on sequences wholly within the trained length or past it.
        scaling = {**scaling, "long": max_model_len > trained}
    switch = _switch(cfg, scaling, max_model_len)
    return replace(cfg, rope_scaling=scaling, rope_switch_length=switch[0] if switch else None,
                   short_rope_scaling=switch[1] if switch else None), max_model_len


def _switch(cfg: ModelConfig, scaling: dict | None, max_model_len: int) -> tuple[int, dict | None] | None:
    """(length, short scaling) where a sequence of at most `length` tokens must rotate otherwise than by `scaling`,
    as transformers runs the model's own config: scaling we add past the model's context (automatic YaRN or a
    rope_scaling setting) leaves shorter sequences as the file has them, and LongRoPE uses its short factors up to
    the trained length. A file's own YaRN, linear or llama3 scaling applies at every length (DeepSeek's, gpt-oss's,
    Llama 3.1's): no switch. None: no switch (every sequence rotates by `scaling`)."""
    own = cfg.rope_scaling
    if scaling is None or (scaling == own and own["rope_type"] != "longrope"):
        return None
    if own is not None and own["rope_type"] == "longrope":
        length, short = own["original_max_position_embeddings"], {**own, "long": False}
    else:
        length, short = _context(cfg, own, trained_length(cfg)), own
    return (length, short) if length < max_model_len else None


def serving_config(config: EngineConfig, model: str) -> EngineConfig:
    """`serve`'s settings for one of its models: a known model's serving length (smollm2: 32768, YaRN x4) when
    neither max_model_len nor rope_scaling is given, by its alias (a path is served as any file, wherever the
    home is); the offline LLM keeps the model's own context."""
    from backend.model_store import KNOWN_MODELS

    entry = KNOWN_MODELS.get(model)
    length = config.max_model_len
    if length is None and config.rope_scaling is None and entry is not None:
        length = entry.serve_max_model_len
    return replace(config, model=model, max_model_len=length)


def _describe(scaling: dict | None) -> str:
    if scaling is None:
        return "none"
    return f"{scaling['rope_type']}:{scaling['factor']:g}" if "factor" in scaling else scaling["rope_type"]
