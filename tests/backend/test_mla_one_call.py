"""Latent attention layers in the one-call decode step (cpu_decoder.c's latent_attention): DeepSeek-V2-shaped GGUF
files in both of llama.cpp's kv_b layouts (kv_b's halves read as int8, or W_UK as fp32), q in one projection or
through its low-rank path beside a dense first layer, fp32 and bf16 latent caches: the modules' logits bit for bit,
decode rows and a verification run's rows in one call. Routers the C loop does not run keep the modules."""

import pytest

from backend.config import EngineConfig
from backend.engine.llm_engine import LLMEngine
from backend.kernels import native
from backend.kernels.mla_attention import C_ROWS
from backend.models.mla import LatentAttention
from backend.quant.experts import one_call_tokens
from tests.backend.test_cpu_decoder import assert_one_call_is_the_modules
from tests.backend.tiny_gguf_deepseek import MLA_SHAPES, convert, write_gguf
from tests.backend.tiny_models import build_model

pytestmark = pytest.mark.skipif(native.library() is None, reason="no C compiler for the CPU kernels")


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root, built = tmp_path_factory.mktemp("mla-one-call"), {}

    def get(variant: str, split: bool = True):
        if (variant, split) not in built:
            if variant == "q_lora":  # V2's softmax router with q's low-rank path and a dense first layer
                hf = build_model(
                    "deepseek_v2",
                    root / "q_lora-hf",
                    **dict(MLA_SHAPES, q_lora_rank=64, first_k_dense_replace=1, num_hidden_layers=3),
                )
                built[variant, split] = convert(hf, root / "q_lora.gguf", split, reference=False)[0]
            else:
                built[variant, split] = write_gguf(variant, root, split)[0]
        return built[variant, split]

    return get


def engine_of(path, kv_cache_dtype: str = "auto") -> LLMEngine:
    return LLMEngine(
        EngineConfig(
            model=str(path),
            block_size=8,
            kv_cache_dtype=kv_cache_dtype,
            speculative={"method": "ngram", "num_tokens": 3},
        )
    )


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "bfloat16"])
@pytest.mark.parametrize(
    ("variant", "split"), [("deepseek2_v2", True), ("deepseek2_v2", False), ("q_lora", True)]
)
def test_latent_layers_in_one_call_are_the_modules_bit_for_bit(variant, split, kv_cache_dtype, files):
    engine = engine_of(files(variant, split), kv_cache_dtype)
    layers = engine.runner.model.model.layers
    assert all(isinstance(layer.self_attn, LatentAttention) for layer in layers)
    assert layers[0].self_attn.q_lora == (variant == "q_lora")
    decoder = engine.runner.cpu_decoder
    assert decoder is not None and decoder.max_rows == min(one_call_tokens(), C_ROWS)
    assert_one_call_is_the_modules(engine)


@pytest.mark.parametrize("variant", ["deepseek2_v2_grouped", "deepseek2_v3"])
def test_group_limited_and_sigmoid_routers_keep_their_modules(variant, files):
    """Their routers' logits are torch's matmul in the modules (models/moe.py): not the C loop's bits."""
    assert engine_of(files(variant)).runner.cpu_decoder is None
