"""The engine loop: requests in, one planned forward pass per step, deltas out.

request -> plan (scheduler) -> rows and forward (runner) -> sample (plan_sampling) -> postprocess (scheduler)
-> deltas (deltas). Everything one request can get wrong is refused before it is queued
(admission), and a failure while processing one sequence ends only its request. How the engine is put
together is engine/engine_setup.py's; what it holds on its device and when, engine/residency.py's.
"""

import itertools
import logging
import time

from backend.config import EngineConfig
from backend.engine import disk_prefix_cache, engine_setup, residency, rope_switch
from backend.engine.admission import AdmittedEmbedding, AdmittedRequest, Limits, admit, request_sequences
from backend.engine.block_manager import BlockManager
from backend.engine.cache_groups import sliding_of, token_bytes
from backend.engine.deltas import Handed, OutputAssembler, RequestDelta, request_delta
from backend.engine.embedding import embedding_delta, embedding_sequences
from backend.engine.guided import GuidedDecoding
from backend.engine.guided_reasoning import think_first
from backend.engine.kv_budget import CacheShape, num_kv_blocks, report_memory
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
from backend.speculative.draft import DraftProposer
from backend.speculative.speculative_config import SpeculativeConfig

log = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, config: EngineConfig):
        """Every part of the engine, built here from its config in the order each needs the others; each attribute
        is written here (and by sleep/wake_up for what they change), none by another module."""
        self.config = config
        self.device = engine_setup.pick_device(config)
        self.source = locate(config.model)
        self.model_config, reader = residency.read_model_config(self.source, config)
        self.dtype, self.products = engine_setup.pick_arithmetic(config, self.device, self.model_config, reader)
        self.spec = SpeculativeConfig.parse(config.speculative)
        self.shape = CacheShape.of(config, self.model_config, self.spec, self.device, self.dtype)
        self.max_model_len, self.max_num_batched_tokens = self.shape.max_model_len, self.shape.max_num_batched_tokens
        self.model_name = config.model
        self.tokenizer = load_tokenizer(self.source, config.tokenizer)
        self.eos_token_ids = engine_setup.end_tokens(self.model_config, self.tokenizer)
        self.limits = Limits.of(self.tokenizer, self.model_config.vocab_size, self.max_model_len, config.max_n,
                                config.max_num_seqs, config.max_embedding_tokens)

        loaded = self._load_models(reader, config.moe_gpu_experts)
        self.moe_gpu_experts, self.vocab_bridge = loaded.moe_gpu_experts, loaded.vocab_bridge
        models = [m for m in (loaded.model, loaded.draft) if m is not None]
        self.num_kv_blocks = num_kv_blocks(config, self.shape, models)
        self.runner = ModelRunner(loaded.model, self.num_kv_blocks, config.block_size, self.device, self.dtype,
                                  self.shape.kv_dtype, config.max_num_seqs if is_hybrid(self.model_config) else 0,
                                  sliding_of(config, self.shape, self.model_config, self.num_kv_blocks))
        self.disk_cache = disk_prefix_cache.for_engine(config, self.source, self.model_config, self.runner,
                                                       self.products, self.shape.kv_dtype)  # None: off
        self.block_manager = BlockManager(self.num_kv_blocks, config.block_size, config.enable_prefix_caching,
                                          self.disk_cache, self.runner.state_slots, self.runner.sliding)
        target = config.step_time_budget or (0.25 if self.device.type == "cpu" else 0.05)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, self.max_num_batched_tokens,
                                   StepBudget(target, self.shape.prefill_tokens_while_decoding),
                                   config.long_prefill_token_threshold,
                                   rope_switch.of(loaded.model))  # short sequences exact under added scaling
        self.sampler = Sampler(config.seed, self.device, lambda: GuidedDecoding(
            self.tokenizer, self.model_config.vocab_size, max_schema_bytes=config.max_schema_bytes))
        self.proposer, self.speculator = engine_setup.speculation(
            self.spec, loaded.draft, loaded.model, self.device, self.dtype, self.num_kv_blocks, config.block_size,
            self.shape.kv_dtype, self.vocab_bridge, self.max_model_len)
        if self.speculator is not None:
            self.scheduler.on_release.append(self.speculator.release)
        self._capture_graphs()
        self.sleep_level = 0  # 0 awake; 1 weights offloaded to CPU memory; 2 weights dropped
        report_memory(config, self.device, self.num_kv_blocks, sum(module_bytes(m) for m in models),
                      sum(host_expert_bytes(m) for m in models), state_pool_bytes(self.model_config, config.max_num_seqs),
                      *token_bytes(models, self.runner.sliding, self.shape.kv_dtype), self.runner.sliding)
        self.requests: dict[str, list[Sequence]] = {}
        self.prompts: dict[str, str | None] = {}  # each request's prompt text, for the outputs of step()
        self.handed: dict[str, list[Handed]] = {}  # how far each request's deltas have gone, per sequence
        self.assemblers: dict[str, OutputAssembler] = {}  # step()'s cumulative outputs, built from deltas
        self._seq_ids = itertools.count()

    @property
    def model(self):
        """The target's weights, which its runner holds (None while in a level-2 sleep)."""
        return self.runner.model

    def _load_models(self, reader, moe_gpu_experts: int | str | None) -> residency.LoadedModels:
        return residency.load_models(self.config, self.source, self.model_config, reader, self.spec, self.device,
                                     self.dtype, self.products, self.shape, self.tokenizer, moe_gpu_experts)

    def _capture_graphs(self) -> None:
        """On CUDA (unless enforce_eager), the decode graphs of the target's runner and a draft model's."""
        if self.device.type == "cuda" and not self.config.enforce_eager:
            draft = [self.proposer.runner] if isinstance(self.proposer, DraftProposer) else []
            residency.capture_graphs([self.runner, *draft], self.shape)

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
        residency.check_sleep(level, self.has_unfinished_requests())
        if self.sleep_level:
            return
        self.runner.sleep(level)
        if isinstance(self.proposer, DraftProposer):  # the draft's weights and cache go too
            self.proposer.sleep(level)
        self.sleep_level = level
        residency.give_memory_back(self.device)

    def wake_up(self) -> None:
        if not self.sleep_level:
            return
        model = draft = None
        if self.sleep_level == 2:
            _, reader = read_config(self.source)
            loaded = self._load_models(reader, self.moe_gpu_experts)
            model, draft = loaded.model, loaded.draft
        self.runner.wake_up(model, self.num_kv_blocks)
        if isinstance(self.proposer, DraftProposer):
            self.proposer.wake_up(draft, self.num_kv_blocks)
        self.block_manager.forget_contents()  # the blocks it indexed were freed
        self._capture_graphs()
        self.sleep_level = 0

    # Requests ------------------------------------------------------------------------------------------

    def validate_request(self, prompt: str | list[int] | list[dict], params: SamplingParams | dict | None = None,
                         param: str = "prompt") -> AdmittedRequest:
        """Everything that can refuse a request, once: its prompt (text, token ids, or chat messages through the
        model's chat template) and its settings against this engine's limits. Raises ValueError (InvalidParameter
        naming param or the setting); add_request takes the result as it is. Thread-safe (no engine state)."""
        return admit(self.limits, prompt, as_sampling_params(params), self.tokenizer, self.model_name, param)

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
        params = request.params
        matchers = [self.guided_matcher(params) for _ in range(params.n)]
        # A hybrid model's sequences prefill each their own prompt: a linear layer's state is not shared as blocks are.
        hybrid = self.runner.state_slots > 0
        seqs = request_sequences(request_id, request, self._seq_ids, matchers, group, self.tokenizer, self.device,
                                 share_prompt=not hybrid)
        for seq in seqs if hybrid else seqs[:1]:
            self.scheduler.add(seq)
        self.requests[request_id] = seqs
        self.prompts[request_id] = request.text
        self.handed[request_id] = [Handed() for _ in seqs]

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
        return self.sampler.guided_decoding()

    def guided_matcher(self, params: SamplingParams):
        """A grammar matcher for a structured-output request (None otherwise); raises on an unusable schema."""
        if params.guided_json is None:
            return None
        grammar = self.guided_decoding().matcher(params.guided_json)
        return grammar if params.think_first is None else think_first(grammar, *params.think_first)

    def abort_request(self, request_id: str) -> None:
        for seq in self.requests.get(request_id, []):
            if not seq.finished:
                self.scheduler.finish(seq, "abort")
        self._forget(request_id)
        self.assemblers.pop(request_id, None)

    def _forget(self, request_id: str) -> None:
        for held in (self.requests, self.prompts, self.handed):
            held.pop(request_id, None)

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
        for rid in self.requests:
            if rid not in self.assemblers:
                self.assemblers[rid] = self.output_assembler(rid)
        outputs = []
        for delta in self.step_deltas():
            assembler = self.assemblers[delta.request_id]
            assembler.add(delta)
            outputs.append(assembler.output())
            if delta.finished:
                del self.assemblers[delta.request_id]
        return outputs

    def output_assembler(self, request_id: str) -> OutputAssembler:
        """What builds a queued request's cumulative outputs from its deltas."""
        seqs = self.requests[request_id]
        return OutputAssembler(request_id, self.prompts.get(request_id),
                               seqs[0].token_ids[:seqs[0].num_prompt_tokens], len(seqs))

    def _fail(self, request_id: str, error: str, param: str | None = None) -> None:
        for seq in self.requests.get(request_id, []):
            if not seq.finished:
                self.scheduler.finish(seq, "error", error=error, error_param=param)

    def _delta(self, request_id: str) -> RequestDelta | None:
        seqs = self.requests[request_id]
        if seqs[0].pooling:
            delta = embedding_delta(request_id, seqs)
        else:
            delta = request_delta(request_id, seqs, self.handed[request_id])
        if delta is not None and delta.finished:
            self._forget(request_id)
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
