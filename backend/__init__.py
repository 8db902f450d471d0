"""Scriptorium's inference engine: `from backend import LLM, SamplingParams`, and the step-wise
`from backend import EngineArgs, LLMEngine`."""

import os

# OpenMP's waiting threads (libgomp's, torch's and our kernels') spin 300,000 rounds before they sleep. On cores that
# other programs share (the stack puts ComfyUI, the MCP server and agents beside us), a spinning thread takes the
# time slice that the thread it waits for needs: a 1,900-token prompt took 80-90 s instead of 7-9 s beside a busy
# process. A short spin keeps a quiet machine's hand-offs quick. Set before torch loads its runtime; a value the
# user set wins (OMP_WAIT_POLICY=PASSIVE: no spin at all).
os.environ.setdefault("GOMP_SPINCOUNT", "10000")

from backend.engine.llm_engine import LLMEngine  # noqa: E402
from backend.engine_args import EngineArgs  # noqa: E402
from backend.llm import LLM  # noqa: E402
from backend.outputs import CompletionOutput, Logprob, RequestOutput  # noqa: E402
from backend.sampling_params import SamplingParams  # noqa: E402

__all__ = ["LLM", "CompletionOutput", "EngineArgs", "LLMEngine", "Logprob", "RequestOutput", "SamplingParams"]
