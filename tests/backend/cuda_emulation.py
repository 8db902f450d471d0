"""The CUDA path on the CPU, for tests: what a GPU runs, with the arithmetic interpreted.

- Every op goes through the Triton kernels (SCRIPTORIUM_TRITON=1, under TRITON_INTERPRET=1) and our C kernels are
  off (SCRIPTORIUM_CPU_KERNELS=torch), so the runner lays out its rows as it does on CUDA.
- CUDA graphs are emulated: capture runs the forward once, as the real capture does, under a watcher that fails
  on any host sync our code makes (`.item()`, `.tolist()`, `bool(t)`, `.cpu()`, ...: a graph cannot contain one,
  and a value read then would be frozen into every replay); replay runs the captured module again on the same
  static input tensors and writes into the output tensor the capture returned, as a replay does.
"""

import functools
import sys
from contextlib import contextmanager
from pathlib import Path

import torch

import backend
from backend import LLM, SamplingParams
from backend.kernels import native

BACKEND_DIR = str(Path(backend.__file__).resolve().parent)
SYNCS = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "cpu", "numpy")
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


class HostSyncInCapture(AssertionError):
    pass


class EmulatedGraph:
    """Stands for torch.cuda.CUDAGraph."""

    def __init__(self, *args, **kwargs):
        self.module: torch.nn.Module | None = None
        self.args: tuple = ()
        self.out: torch.Tensor | None = None
        self.replays = 0

    def pool(self) -> None:
        return None

    def replay(self) -> None:
        with torch.inference_mode():
            self.out.copy_(self.module(*self.args))
        self.replays += 1


def _watched(name: str, original):
    def method(self, *args, **kwargs):
        caller = sys._getframe(1).f_code.co_filename
        if caller.startswith(BACKEND_DIR):
            line = sys._getframe(1).f_lineno
            raise HostSyncInCapture(f"Tensor.{name}() at {caller}:{line} inside CUDA graph capture")
        return original(self, *args, **kwargs)

    return method


@contextmanager
def capture(graph: EmulatedGraph, pool=None, **kwargs):
    """Stands for torch.cuda.graph(graph): records the outermost module called inside, its inputs and output."""
    from torch.nn.modules import module as nn_module

    def before(module, args):
        if graph.module is None:
            graph.module, graph.args = module, args

    def after(module, args, output):
        if module is graph.module and graph.out is None:
            graph.out = output

    hooks = [
        nn_module.register_module_forward_pre_hook(before),
        nn_module.register_module_forward_hook(after),
    ]
    originals = {name: getattr(torch.Tensor, name) for name in SYNCS}
    for name, original in originals.items():
        setattr(torch.Tensor, name, _watched(name, original))
    try:
        yield graph
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)
        for hook in hooks:
            hook.remove()
    assert graph.module is not None and isinstance(graph.out, torch.Tensor), "nothing was captured"


def emulate_cuda(monkeypatch) -> None:
    """The CUDA path's kernels and graph calls for engines made after this (a pytest monkeypatch undoes it)."""
    monkeypatch.setenv("SCRIPTORIUM_TRITON", "1")
    monkeypatch.setenv("SCRIPTORIUM_CPU_KERNELS", "torch")
    # enabled() keeps its first answer: a fresh cache reads the setting above, and the undo brings the old one back
    monkeypatch.setattr(native, "enabled", functools.cache(native.enabled.__wrapped__))
    monkeypatch.setattr(torch.cuda, "CUDAGraph", EmulatedGraph)
    monkeypatch.setattr(torch.cuda, "graph", capture)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)


def greedy_tokens(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    """Each prompt's first 6 greedy tokens (end tokens ignored)."""
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


def cpu_tokens_then_emulated(
    monkeypatch, model: str, prompts: list[list[int]], **settings
) -> tuple[list, LLM]:
    """The CPU path's greedy tokens of prompts, then an engine of the same settings on the emulated CUDA path."""
    expected = greedy_tokens(LLM(model, **settings), prompts)
    emulate_cuda(monkeypatch)
    return expected, LLM(model, **settings)


def capture_graphs(llm) -> list:
    """What the engine does on CUDA once its cache is sized: decode graphs for the target's runner and a draft
    model's. Returns the runners that hold graphs (a model with offloaded experts stays eager)."""
    from backend.engine import residency

    engine = llm.engine
    draft = getattr(engine.proposer, "runner", None)
    runners = [r for r in (engine.runner, draft) if r is not None]
    residency.capture_graphs(runners, engine.shape)
    return [r for r in runners if r.graphs]


def replays(runner) -> int:
    return sum(graph.replays for graph, _ in runner.graphs.values())
