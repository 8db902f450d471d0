from pathlib import Path

import pytest
import torch


@pytest.fixture(scope="session")
def hf_model():
    """hf_model(directory) -> the transformers model loaded from it, in fp32, cached."""
    from transformers import AutoModelForCausalLM

    cache = {}

    def get(directory: Path):
        if directory not in cache:
            model = AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32).eval()
            model.generation_config.eos_token_id = None  # compare fixed-length continuations
            cache[directory] = model
        return cache[directory]

    return get


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory):
    """tiny_gguf(family, variant=None, **options) -> (GGUF file, reference directory), built once."""
    from tests.backend.tiny_gguf import build_family, write_gguf

    root = tmp_path_factory.mktemp("tiny-gguf")
    built = {}

    def get(family: str, variant: str | None = None, build: dict | None = None, **options):
        key = (family, variant)
        if key not in built:
            name = family + (f"-{variant}" if variant else "")
            hf = build_family(family, root / name, **(build or {}))
            built[key] = write_gguf(family, hf, root / f"{name}.gguf", **options)
        return built[key]

    return get


def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def hf_next_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0, -1].float()


def prompts_of_lengths(*lengths: int, vocab: int = 400) -> list[list[int]]:
    """Deterministic token-id prompts; lengths chosen by tests to cross block boundaries."""
    return [[(i * 37 + n * 11) % (vocab - 3) + 3 for i in range(n)] for n in lengths]
