"""A Hugging Face config.json as a ModelConfig: the family's reader, picked by the architecture it names."""

from backend.families import deepseek, gemma3, gpt_oss, llama, qwen3_next
from backend.model_config import ModelConfig, ModelLoadError

READERS = {arch: family.from_hf for family in (llama, gemma3, deepseek, qwen3_next, gpt_oss) for arch in family.ARCHITECTURES}


def from_hf_config(cfg: dict, source: str) -> ModelConfig:
    if not isinstance(cfg, dict):
        raise ModelLoadError(f"{source}: config.json must hold a JSON object, not {type(cfg).__name__}")
    archs = cfg.get("architectures") or []
    if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
        raise ModelLoadError(f"{source}: architectures is {archs!r}; it must be a list of names such as "
                             "[\"LlamaForCausalLM\"]")
    arch = next((a for a in archs if a in READERS), None)
    if arch is None:
        raise ModelLoadError(f"{source}: architecture {', '.join(archs) or '(none given)'} is not supported; "
                             f"supported: {', '.join(READERS)}")
    return READERS[arch](cfg, arch, source)
