"""The one table of step paths and attention kernels (backend/kernels/step_paths.py): its answers for
representative devices, dtypes, layer kinds and batches, and real engines taking the path it names: the one-call C
step, the modules, a replayed CUDA graph (in emulation), and the attention kernel it names."""

from dataclasses import replace

import pytest
import torch

from backend import LLM, SamplingParams
from backend.engine.model_runner import path_item
from backend.kernels import native
from backend.kernels.attention import AttentionMetadata, paged_attention
from backend.kernels.step_paths import (
    DECODE_ROWS_CONTEXT,
    GRAPH,
    GRAPH_RUN_ROWS,
    MODULES,
    ONE_CALL,
    SHORT_CONTEXT,
    TORCH,
    TRITON,
    C,
    Item,
    Kernels,
    RunnerParts,
    attends_as_decode,
    attention_kernel,
    captures_graphs,
    graph_buckets,
    graph_rows,
    kernels_for,
    rows_kernel,
    step_path,
)
from tests.backend.conftest import interpreted_only
from tests.backend.cuda_emulation import capture_graphs, emulate_cuda, replays

CPU = RunnerParts(Kernels(c=True, triton=False))
ONE_CALL_CPU = replace(CPU, one_call=True)
TORCH_CPU = RunnerParts(Kernels(c=False, triton=False))
CUDA = RunnerParts(Kernels(c=False, triton=True), graph_rows=16, graph_positions=8192)
DECODE, FAR = 100, DECODE_ROWS_CONTEXT + 1  # tokens already computed


@pytest.mark.parametrize(
    ("parts", "item", "as_decode"),
    [
        (TORCH_CPU, Item(1, 0, FAR), True),  # a decode row, on every path
        (TORCH_CPU, Item(4, 3, DECODE), False),  # torch verifies drafts as one chunk (verify_attention)
        (CPU, Item(4, 3, FAR), True),  # our C kernel verifies as decode rows at any context
        (
            replace(CPU, hybrid=True),
            Item(4, 3, DECODE),
            False,
        ),  # a hybrid model's verification is a run of its own
        (CUDA, Item(4, 3, DECODE_ROWS_CONTEXT), True),
        (CUDA, Item(4, 3, FAR), False),  # each row would read the whole cache again
        (ONE_CALL_CPU, Item(20, 0, SHORT_CONTEXT - 10), True),  # a short chunk joins a one-call decode step
        (ONE_CALL_CPU, Item(20, 0, SHORT_CONTEXT - 9), False),
        (ONE_CALL_CPU, Item(2 * SHORT_CONTEXT, 0, 0), True),  # a fresh prompt of twice that breaks even
        (
            replace(ONE_CALL_CPU, hybrid=True),
            Item(20, 0, 0),
            False,
        ),  # a hybrid's prompt chunk runs through its state, not as rows of sequences of their own
        (replace(ONE_CALL_CPU, hybrid=True, one_call_rows=16), Item(1, 0, DECODE), True),
        (
            replace(ONE_CALL_CPU, one_call_rows=16),
            Item(20, 0, 0),
            False,
        ),  # a MoE model's one call takes few rows
        (CPU, Item(20, 0, 0), False),  # no one-call step: a prompt chunk
    ],
)
def test_which_rows_attend_as_decode_rows(parts, item, as_decode):
    assert attends_as_decode(parts, item.rows, item.drafts, item.computed) is as_decode


DECODE_ROW = Item(1, 0, DECODE)


@pytest.mark.parametrize(
    ("parts", "items", "path"),
    [
        (CUDA, [DECODE_ROW] * 16, GRAPH),
        (CUDA, [DECODE_ROW] * 17, MODULES),  # more rows than the largest graph
        (replace(CUDA, graph_rows=0), [DECODE_ROW], MODULES),  # no graphs captured
        (CUDA, [DECODE_ROW, Item(GRAPH_RUN_ROWS, 0, DECODE)], GRAPH),  # a draft's short catch-up
        (CUDA, [DECODE_ROW, Item(GRAPH_RUN_ROWS + 1, 0, DECODE)], MODULES),  # a prompt chunk
        (CUDA, [Item(GRAPH_RUN_ROWS + 2, GRAPH_RUN_ROWS + 1, DECODE)], GRAPH),  # a verification of 9 drafts
        (CUDA, [Item(2, 1, FAR)], MODULES),
        (CUDA, [Item(1, 0, FAR)], GRAPH),
        (CUDA, [Item(1, 0, CUDA.graph_positions)], MODULES),  # past the graphs' block tables
        (
            CUDA,
            [Item(1, 0, DECODE, every_row=True)],
            MODULES,
        ),  # prompt logprobs or an embedding read every row
        (ONE_CALL_CPU, [DECODE_ROW] * 3 + [Item(4, 3, DECODE)], ONE_CALL),
        (ONE_CALL_CPU, [DECODE_ROW, Item(2 * SHORT_CONTEXT + 1, 0, 0)], MODULES),
        (ONE_CALL_CPU, [DECODE_ROW, Item(1, 0, DECODE, every_row=True)], MODULES),
        (replace(ONE_CALL_CPU, one_call_rows=4), [DECODE_ROW] * 4, ONE_CALL),
        (replace(ONE_CALL_CPU, one_call_rows=4), [DECODE_ROW] * 5, MODULES),
        (CPU, [DECODE_ROW] * 3, MODULES),  # no one-call step for this model
    ],
)
def test_which_path_a_step_takes(parts, items, path):
    assert step_path(parts, items) == path


@pytest.fixture
def kernel_switch():
    """native.enabled() reads SCRIPTORIUM_CPU_KERNELS once: read again in this test, and after it."""
    native.enabled.cache_clear()
    yield
    native.enabled.cache_clear()


def test_graphs_kernels_and_buckets_by_device_dtype_and_layer_kind(monkeypatch, kernel_switch):
    monkeypatch.delenv("SCRIPTORIUM_TRITON", raising=False)
    cpu = torch.device("cpu")
    assert kernels_for(cpu, torch.float32) == Kernels(c=native.library() is not None, triton=False)
    assert kernels_for(cpu, torch.bfloat16) == Kernels(c=False, triton=False)
    monkeypatch.setenv("SCRIPTORIUM_CPU_KERNELS", "torch")
    native.enabled.cache_clear()
    assert kernels_for(cpu, torch.float32) == Kernels(c=False, triton=False)
    assert captures_graphs(hybrid=False, offloaded_experts=False)
    assert not captures_graphs(hybrid=True, offloaded_experts=False)
    assert not captures_graphs(hybrid=False, offloaded_experts=True)
    assert graph_buckets(40) == [1, 2, 4, 8, 16, 32, 40] and graph_buckets(3) == [1, 2, 3]
    assert graph_rows(4, 16, 2048) == 16 and graph_rows(4, 64, 40) == 40 and graph_rows(600, 0, 2048) == 512


def test_the_attention_kernel_by_dtype_layout_and_device(monkeypatch):
    monkeypatch.delenv("SCRIPTORIUM_TRITON", raising=False)
    q, cache = torch.randn(3, 4, 8), torch.zeros(2, 16, 2, 8)
    c = C if native.enabled() else TORCH
    assert attention_kernel(q, cache, cache) == c
    assert attention_kernel(q, cache.half(), cache.half()) == c  # the C kernel reads a narrower cache
    assert attention_kernel(q.bfloat16(), cache, cache) == TORCH
    assert (
        attention_kernel(torch.randn(3, 8, 4).transpose(1, 2), cache, cache) == TORCH
    )  # heads not contiguous
    assert attention_kernel(q, cache, cache.half()) == TORCH
    monkeypatch.setenv("SCRIPTORIUM_TRITON", "1")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert attention_kernel(q, cache, cache) == TRITON and rows_kernel(q, cache, cache) == c


@pytest.mark.skipif(native.library() is None, reason="no C compiler for the CPU kernels")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_attention_runs_the_kernel_the_table_names(dtype, monkeypatch):
    """Decode rows through paged_attention: our C kernel runs exactly when the table says C."""
    monkeypatch.delenv("SCRIPTORIUM_TRITON", raising=False)
    library, calls = native.library(), []
    original = library.decode_attention_rows
    monkeypatch.setattr(
        library, "decode_attention_rows", lambda *args: calls.append(args[3]) or original(*args)
    )
    q, k_cache, v_cache = (
        torch.randn(2, 4, 8, dtype=dtype),
        torch.randn(4, 16, 2, 8),
        torch.randn(4, 16, 2, 8),
    )
    meta = AttentionMetadata(
        slot_mapping=torch.tensor([5, 21]),
        num_decode=2,
        decode_block_tables=torch.tensor([[0], [1]]),
        decode_context_lens=torch.tensor([6, 6]),
    )
    paged_attention(q, k_cache, v_cache, meta, 8**-0.5)
    assert calls == ([2] if attention_kernel(q, k_cache, v_cache) == C else [])


def record_paths(monkeypatch, runner) -> list[str]:
    """Each step's path as the runner's own step counter and independent watches saw it: a call of its one-call
    step or of the model's modules, or a graph's replay."""
    seen: list[str] = []
    decoder_calls, module_calls = [], []
    if runner.cpu_decoder is not None:
        decoder = runner.cpu_decoder
        monkeypatch.setattr(runner, "cpu_decoder", Counted(decoder, decoder_calls))
    runner.model.register_forward_hook(lambda *_: module_calls.append(1))
    execute = runner.execute

    def watched(plan):
        before = (
            dict(runner.steps),
            len(decoder_calls),
            len(module_calls),
            replays(runner) if runner.graphs else 0,
        )
        expected = step_path(runner.path_parts(), [path_item(item) for item in plan])
        out = execute(plan)
        counted = [p for p in runner.steps if runner.steps[p] != before[0][p]]
        replayed = (replays(runner) if runner.graphs else 0) - before[3]
        ran = GRAPH if replayed else ONE_CALL if len(decoder_calls) > before[1] else MODULES
        assert counted == [ran] and ran == expected, (counted, ran, expected)
        assert replayed or (len(module_calls) > before[2]) == (ran == MODULES)
        seen.append(ran)
        return out

    monkeypatch.setattr(runner, "execute", watched)
    return seen


class Counted:
    """A one-call step that counts its calls."""

    def __init__(self, decoder, calls: list):
        self.decoder, self.calls = decoder, calls

    def __getattr__(self, name):
        return getattr(self.decoder, name)

    def __call__(self, *args):
        self.calls.append(1)
        return self.decoder(*args)


REPEATING = [5, 6, 7, 8, 9] * 6  # n-gram speculation finds drafts in it
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.mark.skipif(native.library() is None, reason="no C compiler for the CPU kernels")
def test_a_cpu_engine_takes_the_one_call_step_and_the_modules_where_the_table_says(tiny_dir, monkeypatch):
    llm = LLM(
        str(tiny_dir("llama")),
        block_size=16,
        max_num_seqs=4,
        max_model_len=512,
        quantization="int8",  # the one-call step runs quantized weights
        speculative={"method": "ngram", "prompt_lookup_min": 1, "num_tokens": 3},
    )
    runner = llm.engine.runner
    assert runner.path_parts() == ONE_CALL_CPU  # a dense model on the CPU in fp32: any rows in one call
    seen = record_paths(monkeypatch, runner)
    long_prompt = list(range(3, 403))  # 400 tokens: a first chunk of 256 as decode rows, then 144 past them
    asks_prompt_logprobs = replace(GREEDY, prompt_logprobs=1)
    llm.generate([REPEATING, long_prompt], GREEDY, use_tqdm=False)
    llm.generate([REPEATING], asks_prompt_logprobs, use_tqdm=False)
    assert {ONE_CALL, MODULES} <= set(seen) and GRAPH not in seen
    assert llm.engine.stats()["spec_verifications"] > 0


@interpreted_only
def test_an_emulated_cuda_engine_replays_graphs_where_the_table_says(tiny_dir, monkeypatch, kernel_switch):
    emulate_cuda(monkeypatch)  # our C kernels off, as on a CUDA device
    llm = LLM(
        str(tiny_dir("llama")),
        block_size=16,
        max_num_seqs=4,
        max_model_len=256,
        speculative={"method": "ngram", "prompt_lookup_min": 1, "num_tokens": 3},
    )
    [runner] = capture_graphs(llm)
    parts = runner.path_parts()
    assert parts.kernels == Kernels(c=False, triton=True) and parts.graph_rows == max(runner.graphs) > 0
    seen = record_paths(monkeypatch, runner)
    llm.generate([REPEATING, list(range(3, 23))], replace(GREEDY, max_tokens=6), use_tqdm=False)
    assert {GRAPH, MODULES} <= set(seen) and ONE_CALL not in seen
