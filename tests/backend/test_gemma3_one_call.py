"""Gemma 3 in the one-call decode step (cpu_decoder.c): its (1 + w) norms, the sandwich of norms around each
branch, q/k norms, GELU's tanh form, the local layers' own rotary base and the embedding scale give the modules'
logits bit for bit, for decode rows past the sliding window's edge and a verification run's rows in one call, with
fp32 and 8-bit activations; and the GELU kernel both paths call is the formula to rounding."""

import math

import pytest
import torch

from backend.config import EngineConfig
from backend.engine.llm_engine import LLMEngine
from backend.kernels import native
from backend.models.mlp import gelu_tanh_mul
from tests.backend.test_cpu_decoder import assert_one_call_is_the_modules, one_call_engine
from tests.backend.tiny_gguf_gemma3 import write_gguf

pytestmark = pytest.mark.skipif(native.library() is None, reason="no C compiler for the CPU kernels")
LONGEST_PROMPT = 19  # assert_one_call_is_the_modules's, which then decodes past it


@pytest.fixture(scope="module")
def q4_k_m(tmp_path_factory):
    return write_gguf("Q4_K_M", tmp_path_factory.mktemp("gemma3-one-call"))[0]


def assert_gemma3_in_one_call(engine: LLMEngine) -> None:
    model, decoder = engine.runner.model, engine.runner.cpu_decoder
    windows = {layer.self_attn.sliding_window for layer in model.model.layers}
    assert (
        None in windows and min(w for w in windows if w) < LONGEST_PROMPT
    )  # sliding rows read past the edge
    assert model.own_cos_sin is not None and model.config.sandwich_norms and model.config.norm_unit_offset
    assert decoder is not None and decoder.max_rows is None
    assert_one_call_is_the_modules(engine)


@pytest.mark.parametrize("activations", ["float32", "int8"])
def test_a_gemma3_file_decodes_in_one_call_as_its_modules_do(q4_k_m, activations):
    engine = LLMEngine(
        EngineConfig(
            model=str(q4_k_m),
            block_size=8,
            activations=activations,
            speculative={"method": "ngram", "num_tokens": 3},
        )
    )
    assert_gemma3_in_one_call(engine)


def test_a_gemma3_checkpoint_quantized_at_load_decodes_in_one_call_as_its_modules_do(tiny_dir):
    """config.json's model: head_dim 16 and query_pre_attn_scalar 24 (the scale is not head_dim's), full and
    sliding layers alternating in pairs."""
    assert_gemma3_in_one_call(one_call_engine(tiny_dir("gemma3")))


def test_the_modules_gelu_is_the_c_kernel_and_the_formula_to_rounding():
    """The tanh form's value to a few fp32 roundings, its far negative tail included (where torch's fp32 GELU,
    computing 1 + tanh, cancels to 0 or to a value off by half)."""
    torch.manual_seed(0)
    gate_up = torch.randn(8, 2 * 203) * 6  # 203: vectors of 8 and a tail
    gate_up[0, :4] = torch.tensor([-30.0, -9.5, 0.0, 12.0])  # where tanh saturates, and 0
    kernel = torch.empty(8, 203)
    native.library().gelu_tanh_mul_rows(gate_up.data_ptr(), kernel.data_ptr(), 8, 203)
    assert torch.equal(gelu_tanh_mul(gate_up), kernel)  # the module path's bits are the one-call step's
    gate, up = gate_up.double().chunk(2, dim=-1)
    exact = 0.5 * gate * (1 + torch.tanh(math.sqrt(2 / math.pi) * (gate + 0.044715 * gate**3))) * up
    torch.testing.assert_close(kernel.double(), exact, rtol=4e-6, atol=1e-12)
