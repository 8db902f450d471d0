"""Scriptorium's inference engine: `from backend import LLM, SamplingParams`, and the step-wise
`from backend import EngineArgs, LLMEngine`."""

from backend.engine.llm_engine import LLMEngine
from backend.engine_args import EngineArgs
from backend.llm import LLM
from backend.outputs import CompletionOutput, Logprob, RequestOutput
from backend.sampling_params import SamplingParams

__all__ = ["LLM", "CompletionOutput", "EngineArgs", "LLMEngine", "Logprob", "RequestOutput", "SamplingParams"]
