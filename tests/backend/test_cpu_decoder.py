"""A decode step in one call of our C kernels (backend/models/cpu_decoder.py) computes the same bits as the
model's modules, for decode rows and a verification run's rows together."""

from dataclasses import replace

import pytest
import torch

from backend import LLM, SamplingParams
from backend.config import EngineConfig
from backend.engine.llm_engine import LLMEngine
from backend.kernels import native
from backend.models.cpu_decoder import CpuDecoder
from backend.models.gated_deltanet import GatedDeltaNet
from backend.quant.experts import one_call_tokens
from tests.backend.conftest import fp32_order, prompts_of_lengths
from tests.backend.tiny_gguf_qwen3_next import write_gguf

pytestmark = pytest.mark.skipif(native.library() is None, reason="no C compiler for the CPU kernels")


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_a_decode_step_in_one_call_is_the_modules_bit_for_bit(tiny_gguf, family):
    """Both files mix formats inside fused layers (llama: q, k Q4_0 with v Q8_0; qwen2: K-quants): each part
    writes its columns; Qwen2's q|k|v bias is added after them; Qwen3 norms each head of q and k."""
    path, _ = tiny_gguf(family)
    engine = LLMEngine(EngineConfig(model=str(path), block_size=8, speculative={"method": "ngram", "num_tokens": 3}))
    runner = engine.runner
    assert runner.cpu_decoder is not None
    qkv = runner.model.model.layers[0].self_attn.qkv_proj
    assert len(qkv.parts) == 2 and (qkv.bias is not None) == (family == "qwen2")
    assert_one_call_is_the_modules(engine)


@pytest.mark.parametrize("activations", ["float32", "int8"])
@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe", "qwen2_moe", "olmoe", "granitemoe_shared"])
def test_moe_layers_in_the_one_call_step_are_the_modules_bit_for_bit(tiny_gguf, family, activations):
    """The router (fp32) and the routed experts (our packed layout; quad order with 8-bit activations) in the same
    C call as the attention: the module path's route_rows and moe_tokens, the same bits; more rows than one call's
    experts take go through the modules (whose per-expert loop is faster there). Qwen2-MoE adds its gated shared
    expert after the routed ones, as its module does, Granite-MoE its ungated one (and its multipliers); OLMoE
    norms all of q and of k."""
    path, _ = tiny_gguf(family)
    engine = LLMEngine(EngineConfig(model=str(path), block_size=8, activations=activations,
                                    speculative={"method": "ngram", "num_tokens": 3}))
    stacks = engine.runner.model.model.layers[0].mlp.experts.weights()
    assert {w.layout.order for w in stacks} == {"quads" if activations == "int8" else fp32_order()}
    decoder = engine.runner.cpu_decoder
    assert decoder is not None and decoder.max_rows == one_call_tokens()
    assert decoder.takes(decoder.max_rows) and not decoder.takes(decoder.max_rows + 1)
    assert_one_call_is_the_modules(engine)


@pytest.fixture(scope="module")
def hybrid_files(tmp_path_factory):
    root, built = tmp_path_factory.mktemp("hybrid-gguf"), {}

    def get(arch: str):
        if arch not in built:
            built[arch] = write_gguf(arch, root, quantized=True)[0]
        return built[arch]

    return get


@pytest.mark.parametrize("activations", ["float32", "int8"])
@pytest.mark.parametrize("arch", ["qwen3next", "qwen35moe"])
def test_hybrid_layers_in_the_one_call_step_are_the_modules_bit_for_bit(hybrid_files, arch, activations):
    """Qwen3-Next's and Qwen3.5's linear-attention layers (cpu_deltanet.c, which the modules' decode rows call too:
    qwen3next's projections grouped by key head, qwen35moe's value heads tiled) and their full-attention layers
    (the output gate, per-head (1 + w) q/k norms, partial rotary) in one C call: the same logits, and the same
    convolution and delta-rule states after the step, as the modules; a sequence's first token (its states read as
    zeros, whatever its slot held) beside decode rows."""
    engine = LLMEngine(EngineConfig(model=str(hybrid_files(arch)), block_size=8, activations=activations))
    runner, greedy = engine.runner, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    assert runner.cpu_decoder is not None and runner.model.config.rotary_dim < runner.model.config.head_dim
    for rid, prompt in zip("abc", prompts_of_lengths(5, 11, 19)):
        engine.add_request(rid, prompt, greedy)
    for _ in range(4):
        engine.step_deltas()
    engine.add_request("d", [7], greedy)  # its slot last held nothing of it
    plan = engine.scheduler.schedule({})
    assert [i.num_scheduled_tokens for i in plan] == [1] * 4 and plan[-1].seq.num_computed_tokens == 0
    linear = [m for m in runner._attention_modules() if isinstance(m, GatedDeltaNet)]
    before = [(m.conv_state.clone(), m.delta_state.clone()) for m in linear]
    decoder = runner.cpu_decoder
    runner.cpu_decoder = spy = Spy(decoder)
    fused = runner.execute(plan)
    assert spy.calls == [4]
    after = [(m.conv_state.clone(), m.delta_state.clone()) for m in linear]
    for m, (conv, delta) in zip(linear, before):
        m.conv_state.copy_(conv)
        m.delta_state.copy_(delta)
    runner.cpu_decoder = None
    modules = runner.execute(plan)
    assert torch.equal(fused.logits, modules.logits)
    for m, (conv, delta) in zip(linear, after):
        assert torch.equal(m.conv_state, conv) and torch.equal(m.delta_state, delta)
    runner.cpu_decoder = decoder


@pytest.mark.parametrize("arch", ["qwen3next", "qwen35moe"])
def test_hybrid_speculation_beside_the_one_call_step_keeps_plain_decodings_tokens(hybrid_files, arch):
    """Plain decoding runs in the one-call step; n-gram drafts are verified by the modules (a hybrid's runs are its
    own), their rows through the same C rows, rejected drafts' rows undone: the same greedy tokens."""
    path = str(hybrid_files(arch))
    greedy = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    prompts = [p * 2 for p in prompts_of_lengths(9, 14)]  # the n-gram lookup finds drafts in them
    plain = LLM(path, block_size=8, max_num_seqs=4)
    spec = LLM(path, block_size=8, max_num_seqs=4, speculative={"method": "ngram", "num_tokens": 4,
                                                                 "prompt_lookup_min": 1})
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, greedy, use_tqdm=False)]
    assert plain.engine.runner.steps["one_call"] > 0
    assert [o.outputs[0].token_ids for o in spec.generate(prompts, greedy, use_tqdm=False)] == want
    stats = spec.engine.stats()
    assert stats["spec_draft_tokens"] > stats["spec_accepted_tokens"] and stats["spec_verifications"] > 0


def test_gpt_oss_in_the_one_call_step_is_the_modules_bit_for_bit(tiny_dir):
    """gpt-oss quantized at load: attention sinks in every layer, alternating 12-token windows and full layers,
    q/k/v and o biases, the router's bias (moe_route_rows), the experts' biases and clamped SwiGLU
    (moe_tokens_biased) in one C call: the modules' logits bit for bit, decode rows and a verification run's rows
    past the window."""
    engine = one_call_engine(tiny_dir("gpt_oss"))
    layer = engine.runner.cpu_decoder.layers[0]
    assert layer.sinks and layer.moe.router_bias and layer.moe.bias_gate_up and layer.moe.limit > 0
    assert {engine.runner.cpu_decoder.layers[i].window for i in range(2)} == {0, 12}
    assert_one_call_is_the_modules(engine)


def one_call_engine(directory) -> LLMEngine:
    """An engine quantized at load (int8) with n-gram drafts, as assert_one_call_is_the_modules runs it."""
    return LLMEngine(EngineConfig(model=str(directory), block_size=8, quantization="int8",
                                  speculative={"method": "ngram", "num_tokens": 3}))


def assert_one_call_is_the_modules(engine: LLMEngine) -> None:
    """Three sequences past their prompts, one of them verifying 3 drafts: one call for every row, and the
    modules' logits bit for bit."""
    runner = engine.runner
    greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    for rid, prompt in zip("abc", prompts_of_lengths(5, 11, 19)):
        engine.add_request(rid, prompt, greedy)
    for _ in range(4):
        engine.step_deltas()
    a = next(s for s in engine.scheduler.running if s.request_id == "a")
    plan = engine.scheduler.schedule({a.seq_id: 3})
    assert all(i.seq.num_tokens - i.seq.num_computed_tokens == 1 for i in plan)  # prompts done: a decode step
    plan = [replace(i, draft_tokens=[3, 1, 4], num_scheduled_tokens=4) if i.seq is a else i for i in plan]
    item = next(i for i in plan if i.seq is a)

    decoder = runner.cpu_decoder
    runner.cpu_decoder = spy = Spy(decoder)
    fused = runner.execute(plan)
    assert spy.calls == [len(plan) + 3]  # one call for every row, the verification run's included
    runner.cpu_decoder = None
    modules = runner.execute(plan)  # the same keys and values rewritten into the same slots
    assert torch.equal(fused.logits, modules.logits) and fused.logit_rows == modules.logit_rows
    rows = fused.logit_rows[next(k for k, i in enumerate(plan) if i is item)]
    assert rows.stop - rows.start == 4
    runner.cpu_decoder = decoder
    for rid in "abc":
        engine.abort_request(rid)


class Spy:
    """The decoder, counting the rows of each call."""

    def __init__(self, decoder: CpuDecoder):
        self.decoder, self.calls = decoder, []

    def __getattr__(self, name):
        return getattr(self.decoder, name)

    def __call__(self, input_ids, *args):
        self.calls.append(input_ids.shape[0])
        return self.decoder(input_ids, *args)


def test_models_outside_the_c_loop_keep_their_modules(tiny_dir):
    """Float weights are the modules' to compute."""
    for path in (tiny_dir("llama"),):
        engine = LLMEngine(EngineConfig(model=str(path), block_size=8, max_model_len=128))
        assert CpuDecoder.build(engine.runner.model) is None and engine.runner.cpu_decoder is None
