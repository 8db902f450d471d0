"""The engine loop: requests in, one planned forward pass per step, deltas out.

request -> plan (scheduler) -> rows and forward (runner) -> sample (plan_sampling) -> postprocess (scheduler)
-> deltas (deltas). Everything one request can get wrong is refused before it is queued
(admission), and a failure while processing one sequence ends only its request. How the engine is put
together is engine/engine_setup.py's; what it holds on its device and when, engine/residency.py's.
"""

import itertools
import logging
import threading
import time

import torch

from backend.config import EngineConfig
from backend.detokenizer import IncrementalDetokenizer
from backend.engine import disk_prefix_cache, engine_setup, residency
from backend.engine.admission import AdmittedEmbedding, AdmittedRequest, Limits, chat_prompt_ids
from backend.engine.block_manager import BlockManager
from backend.engine.deltas import OutputAssembler, RequestDelta, take_delta, take_prompt_logprobs
from backend.engine.embedding import embedding_delta, embedding_sequences
from backend.engine.guided import GuidedDecoding
from backend.engine.kv_budget import (
    CacheShape,
    kv_bytes_per_block,
    num_kv_blocks,
    report_memory,
)
from backend.engine.model_runner import ModelRunner
from backend.engine.plan_sampling import sample_plan
from backend.engine.sampler import Sampler
from backend.engine.scheduler import Scheduler
from backend.engine.sequence import Sequence
from backend.engine.state_pool import is_hybrid, state_pool_bytes
from backend.engine.step_budget import StepBudget
from backend.engine_args import EngineArgs
from backend.loader import load_tokenizer, locate, read_config
from backend.outputs import RequestOutput
from backend.quant.weight_sizes import host_expert_bytes, module_bytes
from backend.sampling_params import InvalidParameter, SamplingParams, as_sampling_params
from backend.spec.speculative_config import SpeculativeConfig

log = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.device = engine_setup.pick_device(config)
        self.source = locate(config.model)
        self.model_config, reader = residency.read_model_config(self)
        self.dtype, self.products = engine_setup.pick_arithmetic(config, self.device, self.model_config, reader)
        self.spec = SpeculativeConfig.parse(config.speculative)
        self.shape = CacheShape.of(config, self.model_config, self.spec, self.device, self.dtype)
        self.max_model_len, self.max_num_batched_tokens = self.shape.max_model_len, self.shape.max_num_batched_tokens
        self.model_name = config.model
        self.tokenizer = load_tokenizer(self.source, config.tokenizer)
        self.eos_token_ids = engine_setup.end_tokens(self.model_config, self.tokenizer)
        self.moe_gpu_experts = config.moe_gpu_experts  # "auto" becomes a count (or None) once chosen
        self.limits = Limits.of(self.tokenizer, self.model_config.vocab_size, self.max_model_len, config.max_n,
                                config.max_num_seqs, config.max_embedding_tokens)

        self.vocab_bridge = None  # a draft with another vocabulary: how its tokens meet the target's
        self.model, draft_model = residency.load_models(self, reader)
        models = [m for m in (self.model, draft_model) if m is not None]
        self.num_kv_blocks = num_kv_blocks(config, self.shape, models)
        self.runner = ModelRunner(self.model, 0, config.block_size, self.device, self.dtype, self.shape.kv_dtype,
                                  config.max_num_seqs if is_hybrid(self.model_config) else 0)
        target = config.step_time_budget or (0.25 if self.device.type == "cpu" else 0.05)
        self.scheduler = Scheduler(BlockManager(0, config.block_size), config.max_num_seqs,
                                   self.max_num_batched_tokens,
                                   StepBudget(target, self.shape.prefill_tokens_while_decoding),
                                   config.long_prefill_token_threshold)
        self.sampler = Sampler(config.seed, self.device)
        self.proposer, self.speculator = engine_setup.speculation(
            self.spec, draft_model, self.model, self.device, self.dtype, config.block_size, self.shape.kv_dtype,
            self.vocab_bridge, self.max_model_len)
        if self.speculator is not None:
            self.scheduler.on_release.append(self.speculator.release)
        self.disk_cache = disk_prefix_cache.for_engine(self)  # None: off
        residency.start_cache(self)
        self.sleep_level = 0  # 0 awake; 1 weights offloaded to CPU memory; 2 weights dropped
        report_memory(config, self.device, self.num_kv_blocks, sum(module_bytes(m) for m in models),
                      sum(host_expert_bytes(m) for m in models), state_pool_bytes(self.model_config, config.max_num_seqs),
                      sum(kv_bytes_per_block(m.config, 1, self.shape.kv_dtype) for m in models))
        self.requests: dict[str, list[Sequence]] = {}
        self.prompts: dict[str, str | None] = {}  # each request's prompt text, for the outputs of step()
        self.assemblers: dict[str, OutputAssembler] = {}  # step()'s cumulative outputs, built from deltas
        self._guided_lock = threading.Lock()
        self._seq_ids = itertools.count()

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> "LLMEngine":
        """The step-wise API of nano-vllm-style engines; the file's header is checked before weights load."""
        config = args.create_engine_config()
        model_config, _ = read_config(locate(config.model))
        args.check_model(model_config)
        return cls(config)

    # Sleep and wake: give the accelerator's memory back to other programs (engine/residency.py) ----------

    def sleep(self, level: int = 1) -> None:
        """Free the KV cache (and its prefix cache). Level 1 keeps the weights in CPU memory; level 2
        drops them, to be read from disk again on wake. Only between requests."""
        residency.sleep(self, level)

    def wake_up(self) -> None:
        residency.wake_up(self)

    # Requests ------------------------------------------------------------------------------------------

    def validate_request(self, prompt: str | list[int] | list[dict], params: SamplingParams | dict | None = None,
                         param: str = "prompt") -> AdmittedRequest:
        """Everything that can refuse a request, once: its prompt (text, token ids, or chat messages through the
        model's chat template) and its settings against this engine's limits. Raises ValueError (InvalidParameter
        naming param or the setting); add_request takes the result as it is. Thread-safe (no engine state)."""
        params = as_sampling_params(params)
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], dict):
            if self.tokenizer is None:
                raise ValueError(f"model {self.model_name!r} has no tokenizer: give prompts as token ids")
            ids = chat_prompt_ids(self.tokenizer, prompt, self.model_name)
            token_ids, _ = self.limits.prompt_ids(ids, self.tokenizer, self.model_name, param)
            text = self.tokenizer.decode(token_ids)
        else:
            token_ids, text = self.limits.prompt_ids(prompt, self.tokenizer, self.model_name, param)
        self.limits.check(params)
        return AdmittedRequest(token_ids, params, text)

    def add_request(self, request_id: str, prompt: AdmittedRequest | str | list[int] | list[dict],
                    params: SamplingParams | dict | None = None, group: str | None = None) -> None:
        """Queue a request, all or nothing: validate_request's result, or a prompt and its params validated here
        (params: SamplingParams or a dict of its fields; None: the defaults). group: the client's request it is
        part of (one completion of several prompts), which takes its turns at admission as one (None: a request
        of its own)."""
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        if isinstance(prompt, AdmittedRequest):
            if params is not None:
                raise ValueError("an admitted request carries its own params: give them to validate_request")
            request = prompt
        else:
            request = self.validate_request(prompt, params)
        token_ids, params, text = request.token_ids, request.params, request.text
        matchers = [self.guided_matcher(params) for _ in range(params.n)]
        seqs = []
        for i in range(params.n):
            seq = Sequence(
                seq_id=next(self._seq_ids), request_id=request_id, index=i, token_ids=list(token_ids),
                num_prompt_tokens=len(token_ids), params=params, matcher=matchers[i], group=group,
                detokenizer=IncrementalDetokenizer(self.tokenizer, token_ids, params.skip_special_tokens)
                if self.tokenizer is not None else None,
                generator=torch.Generator(device=self.device).manual_seed(params.sequence_seed(i))
                if params.seed is not None else None,
            )
            seqs.append(seq)
        # The prompt is prefilled once, for the first sequence; the others fork from it (Scheduler.start_forks).
        # A hybrid model's prefill each their own: a linear layer's state is not shared as blocks are.
        hybrid = self.runner.state_slots > 0
        seqs[0].forks = [] if hybrid else seqs[1:]
        if params.prompt_logprobs is not None:
            seqs[0].prompt_logprobs = [None] * len(token_ids)
        for seq in seqs if hybrid else seqs[:1]:
            self.scheduler.add(seq)
        self.requests[request_id] = seqs
        self.prompts[request_id] = text

    def add_embedding_request(self, request_id: str, inputs: AdmittedEmbedding | list[list[int]]) -> None:
        """Queue inputs of token ids to embed (engine/embedding.py): the step that finishes the last one hands
        out their vectors in RequestDelta.embeddings. Raw inputs are refused whole (InvalidParameter) past the
        limits; Limits.check_embedding's result is taken as it is."""
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        if not isinstance(inputs, AdmittedEmbedding):
            inputs = self.limits.check_embedding(inputs)
        seqs = embedding_sequences(request_id, inputs.inputs, self._seq_ids)
        for seq in seqs:
            self.scheduler.add(seq)
        self.requests[request_id] = seqs
        self.prompts[request_id] = None

    def guided_decoding(self) -> GuidedDecoding:
        """The engine's structured-output grammars (made on first use). Thread-safe: the server compiles schemas
        off the engine thread."""
        with self._guided_lock:
            if self.sampler.guided is None:
                self.sampler.guided = GuidedDecoding(self.tokenizer, self.model_config.vocab_size,
                                                     max_schema_bytes=self.config.max_schema_bytes)
            return self.sampler.guided

    def guided_matcher(self, params: SamplingParams):
        """A grammar matcher for a structured-output request (None otherwise); raises on an unusable schema."""
        if params.guided_json is None:
            return None
        return self.guided_decoding().matcher(params.guided_json)

    def abort_request(self, request_id: str) -> None:
        for seq in self.requests.pop(request_id, []):
            if not seq.finished:
                self.scheduler.finish(seq, "abort")
        self.assemblers.pop(request_id, None)
        self.prompts.pop(request_id, None)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_work()

    # The loop ------------------------------------------------------------------------------------------

    def step_deltas(self) -> list[RequestDelta]:
        """Run one planned forward pass; return what it changed, per request it advanced."""
        started = time.perf_counter()
        wanted = self.speculator.wanted(self.scheduler.running) if self.speculator else None
        plan = self.scheduler.schedule(wanted)
        if not plan:
            return []
        if self.speculator:
            plan = self.speculator.propose(plan, self.sampler)
        out = self.runner.execute(plan)
        forks = self.scheduler.start_forks(plan, self.runner.copy_block)
        plan, logit_rows = plan + [f for _, f in forks], out.logit_rows + [out.logit_rows[i] for i, _ in forks]
        tokens, logprobs, failed = sample_plan(self.sampler, plan, out.logits, logit_rows)
        self.runner.commit_states(plan, tokens)
        failed += self.scheduler.postprocess(plan, tokens, self.eos_token_ids, self.max_model_len, self.tokenizer,
                                             out.pooled, out.prompt_logprobs, logprobs)
        if self.speculator:
            self.speculator.learn(plan, tokens)
        self.scheduler.observe(time.perf_counter() - started)
        for seq, error in failed:
            log.error("request %s failed: %s: %s", seq.request_id, type(error).__name__, error)
            if isinstance(error, InvalidParameter):  # its settings contradict each other: the client's to change
                self._fail(seq.request_id, str(error), error.param)
            else:
                self._fail(seq.request_id, f"{type(error).__name__}: {error}")
        deltas = (self._delta(rid) for rid in dict.fromkeys(item.seq.request_id for item in plan))
        return [d for d in deltas if d is not None]

    def step(self) -> list[RequestOutput]:
        """step_deltas() as vLLM's engines report it: each advanced request's output so far."""
        for rid, seqs in self.requests.items():
            if rid not in self.assemblers:
                self.assemblers[rid] = OutputAssembler(rid, self.prompts.get(rid), seqs[0].token_ids[
                    :seqs[0].num_prompt_tokens], len(seqs))
        outputs = []
        for delta in self.step_deltas():
            assembler = self.assemblers[delta.request_id]
            assembler.add(delta)
            outputs.append(assembler.output())
            if delta.finished:
                del self.assemblers[delta.request_id]
        return outputs

    def _fail(self, request_id: str, error: str, param: str | None = None) -> None:
        for seq in self.requests.get(request_id, []):
            if not seq.finished:
                self.scheduler.finish(seq, "error", error=error, error_param=param)

    def _delta(self, request_id: str) -> RequestDelta | None:
        seqs = self.requests[request_id]
        if seqs[0].pooling:
            delta = embedding_delta(request_id, seqs)
        else:
            changed = [d for d in (take_delta(s) for s in seqs) if d is not None]
            failed = next((s for s in seqs if s.error), None)
            delta = RequestDelta(request_id, changed, all(s.finished for s in seqs),
                                 failed and failed.error, seqs[0].num_cached_tokens or 0,
                                 prompt_logprobs=take_prompt_logprobs(seqs[0]), error_param=failed and failed.error_param)
        if delta is not None and delta.finished:
            del self.requests[request_id]
            self.prompts.pop(request_id, None)
        return delta

    def stats(self) -> dict:
        bm, spec = self.block_manager, self.speculator.stats if self.speculator else {}
        return {"running": len(self.scheduler.running), "waiting": len(self.scheduler.waiting),
                "kv_cache_usage": bm.usage(), "num_kv_blocks": bm.num_blocks, "num_free_blocks": bm.num_free_blocks,
                "prefix_cache_queries": bm.prefix_queries, "prefix_cache_hits": bm.prefix_hits,
                "num_preemptions": self.scheduler.num_preemptions, "sleeping": self.sleep_level,
                **{f"spec_{k}": spec.get(k, 0) for k in ("draft_tokens", "accepted_tokens", "verifications")},
                "spec_method": None if self.spec is None else self.spec.method + _vocab_suffix(self.vocab_bridge)}


def _vocab_suffix(bridge) -> str:
    """How a draft meets the target's vocabulary, as metrics and benches name it."""
    return "" if bridge is None else "-string" if bridge.by_string else "-intersection"
