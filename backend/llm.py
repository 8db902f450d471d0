"""The offline API, shaped like vLLM's: LLM(model).generate(prompts, SamplingParams(...))."""

import itertools
import sys
from collections.abc import Sequence as Seq

from backend.config import EngineConfig
from backend.engine.admission import chat_prompt_ids
from backend.engine.llm_engine import LLMEngine
from backend.outputs import RequestOutput
from backend.sampling_params import SamplingParams

Prompt = str | list[int] | dict


class LLM:
    def __init__(self, model: str, **engine_args):
        """engine_args are EngineConfig's fields (backend/config.py: device, dtype, max_model_len, speculative, ...)."""
        self.engine = LLMEngine(EngineConfig(model=model, **engine_args))
        self._ids = itertools.count()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: Prompt | Seq[Prompt], sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """One RequestOutput per prompt, in order. A prompt is text, a list of token ids, or
        {"prompt": text} / {"prompt_token_ids": ids}."""
        prompt_list = _as_prompt_list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompt_list)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompt_list):
                raise ValueError(f"got {len(params_list)} SamplingParams for {len(prompt_list)} prompts; "
                                 "give one, or one per prompt")
        requests = [self.engine.validate_request(prompt, params) for prompt, params in zip(prompt_list, params_list)]
        ids = []
        try:
            for request in requests:
                request_id = str(next(self._ids))
                self.engine.add_request(request_id, request)
                ids.append(request_id)
            return self._run(ids, use_tqdm)
        except BaseException:
            for request_id in ids:  # leave the engine clean if a prompt was refused or the user interrupted
                self.engine.abort_request(request_id)
            raise

    def chat(self, messages: list[dict] | list[list[dict]], sampling_params: SamplingParams | None = None,
             add_generation_prompt: bool = True, chat_template: str | None = None,
             use_tqdm: bool = True) -> list[RequestOutput]:
        """Applies the model's chat template to one conversation (a list of {"role", "content"}) or to several."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        tokenizer = self.engine.tokenizer
        prompts = [chat_prompt_ids(tokenizer, c, self.engine.model_name, chat_template, add_generation_prompt)
                   for c in conversations]
        outputs = self.generate(prompts, sampling_params, use_tqdm=use_tqdm)
        for out in outputs:
            out.prompt = tokenizer.decode(out.prompt_token_ids)
        return outputs

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        from rich.progress import Progress

        engine = self.engine
        assemblers = {request_id: engine.output_assembler(request_id) for request_id in ids}
        results: dict[str, RequestOutput] = {}
        show = use_tqdm and sys.stderr.isatty()
        with Progress(transient=True, disable=not show) as progress:
            task = progress.add_task("generating", total=len(ids))
            while len(results) < len(ids):
                deltas = engine.step_deltas()
                if not deltas and not engine.has_unfinished_requests():
                    raise RuntimeError("the engine stopped with requests unfinished; this is a bug, please report it")
                for delta in deltas:
                    assemblers[delta.request_id].add(delta)
                    if delta.finished:
                        results[delta.request_id] = assemblers[delta.request_id].output()
                        progress.advance(task)
        return [results[i] for i in ids]


def _as_prompt_list(prompts) -> list[str | list[int]]:
    if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
        prompts = [prompts]
    result = []
    for p in prompts:
        if isinstance(p, dict):
            if "prompt_token_ids" in p:
                p = list(p["prompt_token_ids"])
            elif "prompt" in p:
                p = p["prompt"]
            else:
                raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
        elif not isinstance(p, (str, list)):
            raise ValueError(f"a prompt is a string or a list of token ids, got {type(p).__name__}")
        result.append(p)
    if not result:
        raise ValueError("no prompts given")
    return result
