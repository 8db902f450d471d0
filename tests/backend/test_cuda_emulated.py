"""The whole CUDA path end to end on the CPU (tests/backend/cuda_emulation.py): Triton kernels interpreted, CUDA
graphs captured and replayed in emulation with a watch for host syncs. Greedy tokens must be the CPU path's:
quantized GGUF models (dense and MoE, experts resident and offloaded), prefix-cached prefill, speculative decoding
with graphs on both runners; fp16 weights, eager against graphs."""

import pytest

from backend import LLM
from backend.kernels.step_paths import GRAPH_RUN_ROWS
from tests.backend.conftest import interpreted_only, prompts_of_lengths
from tests.backend.cuda_emulation import capture_graphs, emulate_cuda, greedy_tokens, replays

pytestmark = interpreted_only
SETTINGS = dict(block_size=16, max_num_seqs=4, max_model_len=256)
PROMPTS = prompts_of_lengths(3, 21, 40)


def cpu_path(model: str, prompts, **settings) -> list[list[int]]:
    return greedy_tokens(LLM(model, **SETTINGS, **settings), prompts)


@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
def test_quantized_models_with_graphs_and_a_cached_prefix(family, tiny_gguf, monkeypatch):
    path = str(tiny_gguf(family)[0])
    longer = [PROMPTS[2] + PROMPTS[1]]  # the third prompt's blocks are cached by the first call
    expected = cpu_path(path, PROMPTS), cpu_path(path, longer)
    emulate_cuda(monkeypatch)
    llm = LLM(path, **SETTINGS)
    [runner] = capture_graphs(llm)
    assert sorted(runner.graphs) == [1, 2, 4]
    assert greedy_tokens(llm, PROMPTS) == expected[0]
    assert greedy_tokens(llm, longer) == expected[1]
    assert replays(runner) > 0 and llm.engine.block_manager.prefix_hits > 0


@pytest.mark.parametrize("cpu_compute", [False, True])
def test_offloaded_experts_stay_eager_and_agree(cpu_compute, tiny_gguf, monkeypatch):
    """Experts copied in as routed to, or (moe_cpu_compute) computed in host memory: the CPU path's tokens."""
    path = str(tiny_gguf("mixtral")[0])
    expected = cpu_path(path, PROMPTS)
    emulate_cuda(monkeypatch)
    llm = LLM(path, **SETTINGS, moe_gpu_experts=2, moe_cpu_compute=cpu_compute)
    assert capture_graphs(llm) == []  # the host reads the routing (which experts to copy in, or to compute): no graph
    assert greedy_tokens(llm, PROMPTS) == expected


@pytest.mark.parametrize("spec", [{"method": "draft", "num_tokens": 3}, {"method": "ngram", "prompt_lookup_min": 1}])
def test_speculative_decoding_with_graphs_on_both_runners(spec, tiny_dir, monkeypatch):
    target, draft = str(tiny_dir("llama")), str(tiny_dir("qwen2"))
    spec = {**spec, "model": draft} if spec["method"] == "draft" else spec
    expected = cpu_path(target, PROMPTS)
    emulate_cuda(monkeypatch)
    llm = LLM(target, **SETTINGS, speculative=spec)
    runners = capture_graphs(llm)
    assert len(runners) == (2 if spec["method"] == "draft" else 1)
    eager = {id(r): [] for r in runners}  # the plans each runner ran without a graph
    for runner in runners:
        monkeypatch.setattr(runner, "prepare", _recording(runner.prepare, eager[id(runner)]))
    assert greedy_tokens(llm, PROMPTS) == expected
    stats = llm.engine.stats()
    assert stats["spec_draft_tokens"] > 0 and stats["spec_verifications"] > 0
    assert all(replays(r) > 0 for r in runners)
    # Verifications and the draft's catch-ups replay graphs: only prompts longer than a short run go eagerly
    for plans in eager.values():
        assert all(any(item.num_scheduled_tokens > GRAPH_RUN_ROWS and not item.num_draft for item in plan)
                   for plan in plans), [[(i.num_scheduled_tokens, i.num_draft) for i in plan] for plan in plans]


def _recording(prepare, plans: list):
    def recorded(plan):
        plans.append(plan)
        return prepare(plan)
    return recorded


def test_fp16_weights_replay_what_eager_steps_compute(tiny_dir, monkeypatch):
    emulate_cuda(monkeypatch)
    model = str(tiny_dir("qwen3"))
    eager = greedy_tokens(LLM(model, **SETTINGS, dtype="float16"), PROMPTS)
    llm = LLM(model, **SETTINGS, dtype="float16")
    [runner] = capture_graphs(llm)
    assert greedy_tokens(llm, PROMPTS) == eager and replays(runner) > 0


def test_the_emulated_graph_replays_its_inputs_and_catches_host_syncs():
    """The emulation itself: a replay reads the static inputs' new values into the captured output, and a forward
    that reads a tensor's value on the host, written in backend/, fails its capture."""
    import torch

    from backend.kernels import rotary
    from tests.backend.cuda_emulation import EmulatedGraph, HostSyncInCapture, capture

    class Double(torch.nn.Module):
        def forward(self, x):
            return x * 2

    class Syncing(torch.nn.Module):
        def forward(self, x):
            return x * float(x.sum())  # as `.item()` or `if x.sum() > 0:` would

    Syncing.forward.__code__ = Syncing.forward.__code__.replace(co_filename=rotary.__file__)  # as if in backend/
    static = torch.ones(3)
    graph = EmulatedGraph()
    with capture(graph):
        out = Double()(static)
    static.copy_(torch.tensor([1.0, 2.0, 3.0]))
    graph.replay()
    assert out.tolist() == [2.0, 4.0, 6.0]
    with pytest.raises(HostSyncInCapture, match=r"Tensor.__float__\(\) at .*rotary.py"), capture(EmulatedGraph()):
        Syncing()(static)


def test_emulation_turns_our_c_kernels_off_though_asked_before_and_back_on_after():
    """native.enabled() keeps its first answer; the emulation asks afresh (the torch path, as on CUDA) and its undo
    brings the first answer back."""
    from backend.kernels import native

    if not native.enabled():
        pytest.skip("our C kernels are off in this run")
    with pytest.MonkeyPatch.context() as patch:
        emulate_cuda(patch)
        assert not native.enabled()
    assert native.enabled()



@pytest.mark.parametrize("settings, rows", [
    (dict(max_num_seqs=4), 4),  # no speculation: a full decode batch
    (dict(max_num_seqs=4, speculative={"method": "ngram", "num_tokens": 3}), 16),  # 4 sequences verifying 3 drafts
    (dict(max_num_seqs=64, speculative={"method": "ngram"}), 64),  # 4 sequences (max_batch_size) of 8 + 1 rows
    (dict(max_num_seqs=8, max_num_batched_tokens=40, speculative={"method": "ngram", "num_tokens": 16}), 40),
    (dict(max_num_seqs=600), 512),
])
def test_graphs_take_the_rows_a_step_can_replay(settings, rows, tiny_dir):
    """Graph buckets reach what speculation's verifications need, no larger than the step's token budget."""
    llm = LLM(str(tiny_dir("llama")), block_size=16, max_model_len=256, **settings)
    assert llm.engine.shape.graph_rows == rows


def test_the_cache_sizing_warm_up_captures_the_largest_graph(tiny_dir, monkeypatch):
    """On CUDA the KV cache is sized after a warm-up that also captures the largest decode graph once (its memory
    pool stays held beside the cache), released with the throwaway cache."""
    import torch

    from backend.engine.kv_budget import warm_up
    from tests.backend.cuda_emulation import EmulatedGraph

    llm = LLM(str(tiny_dir("llama")), block_size=16, max_model_len=256, max_num_seqs=4)
    captured = []

    class Counted(EmulatedGraph):
        def __init__(self):
            super().__init__()
            captured.append(self)

    emulate_cuda(monkeypatch)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", Counted)
    blocks = warm_up(llm.engine.model, tokens=40, max_model_len=256, block_size=16, device=torch.device("cpu"),
                     dtype=torch.float32, graph_rows=12)
    assert blocks == 3  # 40 tokens in blocks of 16
    [graph] = captured  # the largest bucket alone
    assert graph.args[0].shape == (12,) and graph.out.shape[0] == 12
