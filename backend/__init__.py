"""Scriptorium's inference engine: `from backend import LLM, SamplingParams`."""

from backend.llm import LLM
from backend.outputs import CompletionOutput, Logprob, RequestOutput
from backend.sampling_params import SamplingParams

__all__ = ["LLM", "CompletionOutput", "Logprob", "RequestOutput", "SamplingParams"]
