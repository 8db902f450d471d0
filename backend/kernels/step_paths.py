"""Which way a forward step runs and which kernel attends, decided here alone from the device, the dtype, the
model's layer kinds and the step's rows. The runner (engine/model_runner.py) asks step_path and attends_as_decode,
each attention call (kernels/attention.py) asks attention_kernel. It sits among the kernels so that attention
reads it without importing the engine.

A step runs by the first of these paths that takes it:
  GRAPH     a captured CUDA graph replays it, every row a decode row. CUDA (or its emulation in tests) with
            graphs captured: not for hybrid models or offloaded experts (captures_graphs).
  ONE_CALL  our C decode step runs the whole model in one call (models/cpu_decoder.py), every row a decode row.
            The CPU in fp32 with our C kernels, for the layer kinds that C loop covers (CpuDecoder.build).
  MODULES   the model's modules; each attention call then picks its kernel:
An attention call runs on the first of these kernels that takes its rows:
  TRITON    CUDA, or the Triton interpreter on CPU tensors in tests (SCRIPTORIUM_TRITON=1)
  C         our C kernels: fp32 query rows on the CPU, heads contiguous, a CPU cache of a dtype they read. Decode
            and verification rows: csrc/cpu_attention.c (rows_kernel); prompt chunks, head dim a multiple of 8:
            csrc/cpu_chunk_attention.c (chunk_kernel)
  TORCH     the reference, for everything else
"""

from dataclasses import dataclass

import torch

from backend.kernels import native, use_triton

GRAPH, ONE_CALL, MODULES = "graph", "one_call", "modules"
STEP_PATHS = (GRAPH, ONE_CALL, MODULES)
TRITON, C, TORCH = "triton", "c", "torch"

# A prompt chunk whose rows attend to at most this many positions on average runs as decode rows where a dense model
# has a one-call step: it saves the module path's overhead per row but attends each row alone (SmolLM2, 2 cores,
# measured: a fresh 512-token prompt breaks even; a 20-token chunk after 1000 cached tokens is 30% slower as decode rows).
SHORT_CONTEXT = 256
# With CUDA graphs, a run of up to this many rows that is not a verification (a draft catching up on the tokens it has
# not read, a prompt's uncached tail) replays a decode graph, each row attending alone: at this length that costs far
# less than launching every kernel of an eager step (the reasoning of 09591d3; not measured).
GRAPH_RUN_ROWS = 8
# On the CUDA path several rows of one sequence attend as decode rows only up to this context: each reads the whole
# cache, (1 + k) times the prompt kernel's reads (on paper: Llama-3-8B at 32k, 5 rows read 20 GB of cache against
# 16 GB of weights; not measured on a device yet).
DECODE_ROWS_CONTEXT = 4096
# Larger decode steps run eagerly: launching kernels is then a small part of the step (not measured).
MAX_GRAPH_ROWS = 512


@dataclass(frozen=True)
class Kernels:
    """The kernels a runner's device and dtype give its steps."""

    c: bool  # our C kernels: the CPU, fp32, the library built and not switched off (SCRIPTORIUM_CPU_KERNELS=torch)
    triton: bool  # the Triton kernels: CUDA, or their interpreted twin in tests


def kernels_for(device: torch.device, dtype: torch.dtype) -> Kernels:
    return Kernels(
        c=device.type == "cpu" and dtype == torch.float32 and native.enabled(),
        triton=use_triton(torch.empty(0, device=device)),
    )


@dataclass(frozen=True)
class RunnerParts:
    """What a runner holds that the choice reads; its one-call step and graphs come and go with its cache."""

    kernels: Kernels
    hybrid: bool = False  # linear-attention layers, whose states sit in slots (engine/state_pool.py)
    one_call: bool = False  # a one-call C step is built for this model and cache
    one_call_rows: int | None = (
        None  # the most rows it takes (a MoE model's experts: quant/experts.py); None: any
    )
    graph_rows: int = 0  # the rows of the largest captured graph; 0: none captured
    graph_positions: int = 0  # the positions the graphs' block tables reach


@dataclass(slots=True)
class Item:
    """What the choice reads of one scheduled item (engine/scheduler.py ScheduledSeq); made for each item of every
    step, hence slots (a frozen dataclass takes three times as long to make)."""

    rows: int  # tokens it runs this step, drafts included
    drafts: int  # drafts it verifies
    computed: int  # tokens of its sequence already in the cache
    every_row: bool = False  # it reads rows besides the sampled ones (an embedding input, prompt logprobs)


def attends_as_decode(parts: RunnerParts, rows: int, drafts: int, computed: int) -> bool:
    """Whether an item's rows (drafts of them, computed tokens before them: as Item's) attend as decode rows, each at
    its own position, rather than as one prompt chunk. With our C kernels or the Triton ones a verification is
    decode rows too (each row attends exactly as it would decoding, so greedy speculation keeps plain decoding's
    tokens), and so is a short prompt chunk with a one-call step of any rows: the step stays a decode step. A hybrid
    model's verification and prompt chunks are runs of their own (a linear layer's rows of one sequence follow one
    another through its state; GatedDeltaNet keeps a verification's apart until commit). Plain numbers,
    not an Item: asked for every item of every step."""
    verifies = drafts > 0 and not parts.hybrid
    k = parts.kernels
    return (
        rows == 1
        or (k.c and verifies)
        or (k.triton and verifies and computed <= DECODE_ROWS_CONTEXT)
        or (parts.one_call and parts.one_call_rows is None and not parts.hybrid
            and computed + rows / 2 <= SHORT_CONTEXT)
    )


def step_path(parts: RunnerParts, items: list[Item]) -> str:
    """GRAPH, ONE_CALL or MODULES for a step of these items. A graph takes decode rows, verifications and short
    runs within its tables, none reading rows besides the sampled ones."""
    if (
        parts.graph_rows
        and not any(
            item.every_row
            or item.rows > max(GRAPH_RUN_ROWS, item.drafts + 1)
            or (item.rows > 1 and item.computed > DECODE_ROWS_CONTEXT)
            or item.computed + item.rows > parts.graph_positions
            for item in items
        )
        and sum(item.rows for item in items) <= parts.graph_rows
    ):
        return GRAPH
    if (
        parts.one_call
        and (parts.one_call_rows is None or sum(item.rows for item in items) <= parts.one_call_rows)
        and not any(item.every_row for item in items)
        and all(attends_as_decode(parts, item.rows, item.drafts, item.computed) for item in items)
    ):
        return ONE_CALL
    return MODULES


def captures_graphs(hybrid: bool, offloaded_experts: bool) -> bool:
    """Whether decode graphs are captured: not where the host picks which experts to copy in (MoE layers with
    experts offloaded; resident MoE routing never waits for the host), nor for a hybrid model (a captured step has
    no rows' state slots to read)."""
    return not offloaded_experts and not hybrid


def graph_buckets(largest: int) -> list[int]:
    """The rows of each captured graph: 1, 2, 4, 8, then every 16, up to and including largest."""
    return sorted({b for b in (1, 2, 4, 8) if b <= largest} | set(range(16, largest + 1, 16)) | {largest})


def graph_rows(max_num_seqs: int, verified_rows: int, tokens: int) -> int:
    """The rows of the largest graph: a full decode batch, or the verification of as many sequences as speculation
    serves (verified_rows: each its drafts and one more), as decode rows; no more than a step's tokens."""
    return min(max(max_num_seqs, min(verified_rows, tokens)), MAX_GRAPH_ROWS)


def attention_kernel(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> str:
    """TRITON, C or TORCH for attention of these query rows [rows, heads, head_dim] over this cache."""
    if use_triton(q):
        return TRITON
    return rows_kernel(q, k_cache, v_cache)


def rows_kernel(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> str:
    """C or TORCH for decode or verification rows where no Triton kernel runs them."""
    c = (
        native.usable(q)
        and q.stride(2) == 1
        and q.stride(1) == q.shape[2]
        and k_cache.is_cpu
        and k_cache.dtype in native.KV_KINDS
        and v_cache.dtype == k_cache.dtype
    )
    return C if c else TORCH


def chunk_kernel(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, kernel: str | None = None
) -> str:
    """C or TORCH for a prompt chunk's rows [rows, heads, head_dim] where no Triton kernel runs them (kernel: C or
    TORCH as paged_attention found it for the step; None: asked here). Every chunk whose head dim is a multiple of
    8, a fresh prompt's first included: at SmolLM2's shape, one thread's CPU time on loaded cores, torch's gather and
    SDPA against the C kernel, a layer: 8 rows after 30,000 cached 63.5 -> 10.4 ms, 32 rows 62.7 -> 34.5, 128 rows
    237 -> 138, 512 rows 747 -> 547; a fresh prompt (SDPA is_causal, nothing gathered) of 128 rows 0.66 -> 0.39,
    512 rows 9.6 -> 5.0, 2,048 rows 88 -> 72 (bench/chunk_attention.py)."""
    if (kernel or rows_kernel(q, k_cache, v_cache)) != C or q.shape[2] % 8:
        return TORCH
    return C
