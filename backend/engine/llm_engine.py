"""The engine loop: requests in, one scheduled forward pass per step, outputs out."""

import gc
import itertools
import logging
import os
import threading

import torch

from backend.config import EngineConfig
from backend.detokenizer import IncrementalDetokenizer
from backend.engine.admission import Limits
from backend.engine.block_manager import BlockManager
from backend.engine.guided import GuidedDecoding
from backend.engine.model_runner import ModelRunner
from backend.engine.sampler import Sampler, needs_only_argmax
from backend.engine.scheduler import Scheduler
from backend.engine.sequence import Sequence
from backend.loader import load_model, load_tokenizer, locate, pick_dtype, read_config
from backend.outputs import CompletionOutput, RequestOutput
from backend.sampling_params import SamplingParams
from backend.spec.config import SpeculativeConfig
from backend.spec.draft import DraftProposer, load_draft
from backend.spec.ngram import NgramProposer
from backend.spec.verify import accept_greedy, verify

log = logging.getLogger(__name__)


def best_num_drafts(acceptance: float, max_k: int, cost_per_draft: float) -> int:
    """The k that maximises expected tokens per unit of cost.

    With per-token acceptance a, k drafts yield (1 - a^(k+1)) / (1 - a) tokens on average
    (accepted drafts plus the correction or bonus) for a cost of 1 + k * cost_per_draft.
    """
    best_k, best = 0, 1.0
    for k in range(1, max_k + 1):
        expected = k + 1 if acceptance >= 1 else (1 - acceptance ** (k + 1)) / (1 - acceptance)
        value = expected / (1 + k * cost_per_draft)
        if value > best + 1e-9:
            best_k, best = k, value
    return best_k


def _available_memory(device: torch.device) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


MAX_CUDA_BLOCKS = 1 << 20


def check_cuda_block_size(block_size: int) -> None:
    """The attention kernels load one cache block as a tile: a power of two, and at least the 16 rows
    of a tensor-core matrix product."""
    if block_size < 16 or block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two of at least 16 on CUDA, got {block_size}; use 16 or 32")


def kv_cache_blocks(allowed: int, weights: int, peak: int, warm_cache: int, free: int, per_block: int,
                    setting: float | int) -> int:
    """The KV cache's size in blocks on CUDA. allowed: the bytes this engine may use (its
    gpu_memory_utilization, a per-instance budget as ops hands it out); weights: resident before the
    warm-up; peak: the warm-up's peak (weights, its throwaway cache, activations); free: the card's free
    memory after it (weights still resident)."""
    gib = 2**30
    activations = max(peak - warm_cache - weights, 0)
    kv = allowed - weights - activations
    if kv < per_block:
        raise ValueError(
            f"no room for a KV cache: gpu_memory_utilization={setting} allows {allowed / gib:.1f} GiB, but the "
            f"weights take {weights / gib:.1f} GiB and the activations of a full batch {activations / gib:.1f} GiB; "
            "raise gpu_memory_utilization or lower max_num_batched_tokens")
    if kv + activations > free:
        raise ValueError(
            f"gpu_memory_utilization={setting} allows {allowed / gib:.1f} GiB, but only {(free + weights) / gib:.1f} GiB "
            f"of the card are free for this engine (other programs hold the rest); lower gpu_memory_utilization to "
            f"at most {(free + weights) / gib:.1f}GiB or stop them (ops status shows who holds the card)")
    return kv // per_block


def warm_up(model, tokens: int, max_model_len: int, block_size: int, device: torch.device,
            dtype: torch.dtype, logit_rows: int = 1) -> int:
    """Run the largest prefill batch the scheduler can form once, through a throwaway KV cache, then the
    logits of the most rows one step can sample (a full decode batch, drafts included: 256 rows of a
    152k vocabulary are 230 MB). Returns the throwaway cache's size in blocks (part of the measured peak)."""
    from backend.engine.scheduler import ScheduledSeq

    lengths = []
    while sum(lengths) < tokens:
        lengths.append(min(max_model_len - 1, tokens - sum(lengths)))
    blocks = sum((n + block_size - 1) // block_size for n in lengths)
    runner = ModelRunner(model, blocks, block_size, device, dtype)
    batch, next_block = [], 0
    for n in lengths:
        seq = Sequence(seq_id=-1, request_id="warm-up", index=0, token_ids=[0] * n, num_prompt_tokens=n,
                       params=SamplingParams(max_tokens=1))
        count = (n + block_size - 1) // block_size
        seq.block_table = list(range(next_block, next_block + count))
        next_block += count
        batch.append(ScheduledSeq(seq, n))
    runner.execute(batch)
    with torch.inference_mode():
        model.compute_logits(torch.zeros(logit_rows, model.config.hidden_size, dtype=dtype, device=device))
    runner.free_kv_cache()
    return blocks


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.device = torch.device(config.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError("device 'cuda' was asked for, but PyTorch sees no CUDA GPU; use device='cpu'")
        if self.device.type == "cuda":
            check_cuda_block_size(config.block_size)
        self.source = source = locate(config.model)
        self.model_config, reader = read_config(source)
        self.dtype = pick_dtype(config.dtype, self.device, self.model_config.torch_dtype)
        limit = self.model_config.max_position_embeddings
        self.max_model_len = config.max_model_len or min(limit, 8192)
        self.model_name = config.model
        self.tokenizer = load_tokenizer(source)
        self.model = load_model(source, self.model_config, reader, self.dtype, self.device, self.max_model_len,
                                config.moe_gpu_experts, config.quantization)
        self.eos_token_ids = set(self.model_config.eos_token_ids)
        if getattr(self.tokenizer, "eos_token_id", None) is not None:
            self.eos_token_ids.add(self.tokenizer.eos_token_id)

        self.spec = SpeculativeConfig.parse(config.speculative)
        draft_model = None
        if self.spec is not None and self.spec.method == "draft":
            draft_model = load_draft(self.spec.model, self.model_config, self.device, self.dtype, self.max_model_len)
        self.max_num_batched_tokens = config.max_num_batched_tokens or min(2048, self.max_model_len)

        self.num_kv_blocks = self._num_kv_blocks(draft_model)
        self.block_manager = BlockManager(self.num_kv_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, self.max_num_batched_tokens)
        self.runner = ModelRunner(self.model, self.num_kv_blocks, config.block_size, self.device, self.dtype)
        if self.device.type == "cuda" and not config.enforce_eager:
            self.runner.capture_graphs(config.max_num_seqs, self.max_model_len)
        self.sleep_level = 0  # 0 awake; 1 weights offloaded to CPU memory; 2 weights dropped
        self.sampler = Sampler(config.seed)
        self.proposer = None
        self.draft_cost = 0.0  # a draft token's cost relative to a target decode step (for "auto")
        if self.spec is not None and self.spec.method == "ngram":
            self.proposer = NgramProposer(self.spec.prompt_lookup_min, self.spec.prompt_lookup_max)
        elif self.spec is not None:
            self.proposer = DraftProposer(draft_model, self.device, self.dtype, self.num_kv_blocks, config.block_size)
            if self.device.type == "cuda" and not config.enforce_eager:
                self.proposer.runner.capture_graphs(config.max_num_seqs, self.max_model_len)
            target_params = sum(p.numel() for p in self.model.parameters())
            self.draft_cost = self.proposer.num_parameters / target_params
        if self.proposer is not None:
            self.scheduler.on_release.append(self.proposer.release)
        if self.device.type == "cuda":
            self._report_memory()
        self.spec_stats = {"draft_tokens": 0, "accepted_tokens": 0, "verifications": 0}
        self.requests: dict[str, list[Sequence]] = {}
        self.prompts: dict[str, str | None] = {}
        self.limits = Limits.of(self.tokenizer, self.model_config.vocab_size, self.max_model_len, config.max_n,
                                config.max_num_seqs)
        self._guided_lock = threading.Lock()
        self._seq_ids = itertools.count()

    def _num_kv_blocks(self, draft_model=None) -> int:
        c = self.config
        per_block = ModelRunner.kv_bytes_per_block(self.model_config, c.block_size, self.dtype)
        if draft_model is not None:  # the draft keeps a cache of the same number of blocks
            per_block += ModelRunner.kv_bytes_per_block(draft_model.config, c.block_size, self.dtype)
        needed_per_seq = (self.max_model_len + c.block_size - 1) // c.block_size
        if c.num_kv_blocks is not None:
            blocks = c.num_kv_blocks
        elif c.kv_cache_memory is None and self.device.type == "cuda":
            # A small model on a large card could have tens of millions of blocks, each a Python object in
            # the block manager; past 2**20 (16M tokens at block 16) they would cost host memory and start-up
            # time for a cache no batch fills.
            blocks = min(self._profile_cuda(per_block, draft_model), MAX_CUDA_BLOCKS)
        elif c.kv_cache_memory is not None:
            budget = c.kv_cache_memory if isinstance(c.kv_cache_memory, int) else int(
                c.kv_cache_memory * _available_memory(self.device))
            blocks = budget // per_block
        else:
            # Enough for every sequence slot at full length, but no more than a fifth of free memory
            # (and 2 GiB on the CPU, where the zeroed cache is paid for at start-up).
            cap_bytes = _available_memory(self.device) // 5
            if self.device.type == "cpu":
                cap_bytes = min(cap_bytes, 2 << 30)
            cap = cap_bytes // per_block
            blocks = max(min(c.max_num_seqs * needed_per_seq, cap), needed_per_seq)
        if blocks < needed_per_seq:
            raise ValueError(
                f"the KV cache holds {blocks} blocks of {c.block_size} tokens, but one sequence of max_model_len="
                f"{self.max_model_len} needs {needed_per_seq}; give it more memory or lower max_model_len"
            )
        return blocks

    def _allowed_bytes(self, card_total: int) -> int:
        """gpu_memory_utilization in bytes: a fraction of the card, or bytes already."""
        u = self.config.gpu_memory_utilization
        return int(u * card_total) if isinstance(u, float) else u

    def _report_memory(self) -> None:
        """What the engine holds once ready (weights, KV cache, CUDA graphs); the CUDA context comes on top."""
        held = torch.cuda.memory_reserved(self.device)
        u = self.config.gpu_memory_utilization
        allowed = self._allowed_bytes(torch.cuda.get_device_properties(self.device).total_memory)
        gib = 2**30
        line = (f"KV cache: {self.num_kv_blocks} blocks of {self.config.block_size} tokens; the engine holds "
                f"{held / gib:.2f} GiB of the card, gpu_memory_utilization={u} allows {allowed / gib:.2f} GiB")
        if held > allowed and self.config.num_kv_blocks is None and self.config.kv_cache_memory is None:
            log.warning("%s: over by %.2f GiB (CUDA graphs)", line, (held - allowed) / gib)
        else:
            log.info(line)

    def _max_logit_rows(self) -> int:
        drafts = 0
        if self.spec is not None:
            drafts = self.spec.num_tokens if isinstance(self.spec.num_tokens, int) else self.spec.max_num_tokens
        return min(self.config.max_num_seqs * (1 + drafts), self.max_num_batched_tokens)

    def _profile_cuda(self, per_block: int, draft_model) -> int:
        """Blocks that fit in gpu_memory_utilization once the weights (the draft's too) and the peak
        activations of the largest batch are counted: a warm-up runs that batch and measures it."""
        c = self.config
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        weights = torch.cuda.memory_allocated(self.device)
        warm_blocks = 0
        for model in (m for m in (self.model, draft_model) if m is not None):
            warm_blocks = max(warm_blocks, warm_up(model, self.max_num_batched_tokens, self.max_model_len,
                                                   c.block_size, self.device, self.dtype, self._max_logit_rows()))
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        # The target's throwaway cache: the larger of the two warm-ups, so activations are not undercounted.
        warm_cache = ModelRunner.kv_bytes_per_block(self.model_config, c.block_size, self.dtype) * warm_blocks
        return kv_cache_blocks(self._allowed_bytes(total), weights, peak, warm_cache, free, per_block,
                               c.gpu_memory_utilization)

    # Sleep and wake: give the accelerator's memory back to other programs --------------------------------

    def sleep(self, level: int = 1) -> None:
        """Free the KV cache (and its prefix cache). Level 1 keeps the weights in CPU memory; level 2
        drops them, to be read from disk again on wake. Only between requests."""
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level!r}")
        if self.has_unfinished_requests():
            raise RuntimeError("cannot sleep while requests are running; finish or abort them first")
        if self.sleep_level:
            return
        self.runner.free_kv_cache()
        if level == 2:
            self.runner.model = self.model = None
        elif self.device.type != "cpu":
            self.model.to("cpu")
        if isinstance(self.proposer, DraftProposer):  # the draft's weights and cache go too
            self.proposer.sleep(level)
        self.sleep_level = level
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def wake_up(self) -> None:
        if not self.sleep_level:
            return
        if self.sleep_level == 2:
            self.model_config, reader = read_config(self.source)
            self.model = load_model(self.source, self.model_config, reader, self.dtype, self.device, self.max_model_len,
                                    self.config.moe_gpu_experts, self.config.quantization)
            self.runner.model = self.model
        elif self.device.type != "cpu":
            self.model.to(self.device)
        self.block_manager = BlockManager(self.num_kv_blocks, self.config.block_size, self.config.enable_prefix_caching)
        self.scheduler.block_manager = self.block_manager
        self.runner.allocate_kv_cache(self.num_kv_blocks)
        graphs = self.device.type == "cuda" and not self.config.enforce_eager
        if graphs:
            self.runner.capture_graphs(self.config.max_num_seqs, self.max_model_len)  # the caches are new
        if isinstance(self.proposer, DraftProposer):
            model = None
            if self.sleep_level == 2:
                model = load_draft(self.spec.model, self.model_config, self.device, self.dtype, self.max_model_len)
            self.proposer.wake_up(model, self.num_kv_blocks)
            if graphs:
                self.proposer.runner.capture_graphs(self.config.max_num_seqs, self.max_model_len)
        self.sleep_level = 0

    # Requests ------------------------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams) -> None:
        """Queue a request, all or nothing: everything that can refuse it runs before any part is queued."""
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        token_ids, text = self.limits.prompt_ids(prompt, self.tokenizer, self.model_name)
        self.limits.check(params)
        matchers = [self.guided_matcher(params) for _ in range(params.n)]
        seqs = []
        for i in range(params.n):
            seq = Sequence(
                seq_id=next(self._seq_ids), request_id=request_id, index=i, token_ids=list(token_ids),
                num_prompt_tokens=len(token_ids), params=params,
                detokenizer=IncrementalDetokenizer(self.tokenizer, token_ids, params.skip_special_tokens)
                if self.tokenizer is not None else None,
            )
            if params.seed is not None:
                seq.generator = torch.Generator().manual_seed(params.sequence_seed(i))
            seq.matcher = matchers[i]
            seqs.append(seq)
        # The prompt is prefilled once, for the first sequence; the others fork from it (see _fork).
        seqs[0].forks = seqs[1:]
        self.scheduler.add(seqs[0])
        self.requests[request_id] = seqs
        self.prompts[request_id] = text

    def guided_matcher(self, params: SamplingParams):
        """A grammar matcher for a structured-output request (None otherwise); raises on an unusable schema.
        Thread-safe: the server compiles schemas off the engine thread."""
        if params.guided_json is None:
            return None
        with self._guided_lock:
            if self.sampler.guided is None:
                self.sampler.guided = GuidedDecoding(self.tokenizer, self.model_config.vocab_size)
        return self.sampler.guided.matcher(params.guided_json)

    def abort_request(self, request_id: str) -> None:
        for seq in self.requests.pop(request_id, []):
            if not seq.finished:
                self.scheduler.finish(seq)
                seq.finish_reason = "abort"
        self.prompts.pop(request_id, None)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_work()

    # The loop ------------------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one batch; return the current output of every request it advanced (finished ones last seen).

        A failure while processing one sequence (sampling, its grammar, detokenizing, stop strings, its
        drafts) ends that request with an error and leaves the rest of the batch untouched."""
        if self.proposer is not None:
            self._propose()
        batch = self.scheduler.schedule()
        if not batch:
            return []
        logits = self.runner.execute(batch)  # on the device
        plain: list[Sequence] = []
        plain_rows: list[int] = []
        verifying = []
        row = 0
        for item in batch:
            if not item.samples:
                continue
            if item.num_draft:
                verifying.append((item.seq, row))
            else:
                plain.append(item.seq)
                plain_rows.append(row)
            row += item.num_draft + 1
        for item in batch:
            if not item.num_draft:
                item.seq.num_computed_tokens += item.num_tokens
                self.block_manager.commit(item.seq)
        for seq, r in list(zip(plain, plain_rows)):
            if seq.forks:  # prompt prefilled: the siblings sample their first tokens from the same row
                for child in self._fork(seq):
                    plain.append(child)
                    plain_rows.append(r)
        simple = {seq.seq_id: needs_only_argmax(seq) for seq in plain}
        simple.update((seq.seq_id, needs_only_argmax(seq)) for seq, _ in verifying)
        # Greedy requests need only argmaxes: one small transfer serves them all, whole rows of logits
        # leave the device only for the others.
        top = logits.argmax(dim=-1).tolist() if any(simple.values()) else None
        if plain and all(simple[seq.seq_id] for seq in plain):
            tokens = [top[r] for r in plain_rows]
        else:
            tokens = self._sample(logits, plain_rows, plain) if plain else []
        for seq, token in zip(plain, tokens):
            if token is not None and not seq.finished:
                self._isolated(seq, self._append_token, seq, token)
        for seq, first in verifying:
            if not seq.finished:
                rows = slice(first, first + len(seq.draft_tokens) + 1)
                targets = top[rows] if simple[seq.seq_id] else None
                self._isolated(seq, self._accept_drafts, seq, logits[rows], targets)
        touched = dict.fromkeys(item.seq.request_id for item in batch)
        return [self._request_output(rid) for rid in touched]

    def _fork(self, parent: Sequence) -> list[Sequence]:
        """The parent's prompt is in the cache: its unfinished siblings take it and run from this step."""
        children, parent.forks = [c for c in parent.forks if not c.finished], []
        return [c for c in children if self.scheduler.fork(parent, c, self.runner.copy_block)]

    def _sample(self, logits: torch.Tensor, rows: list[int], seqs: list[Sequence]) -> list[int | None]:
        """The batch's tokens; if sampling the batch fails, each sequence again on its own (from the state its
        generator and logprobs had), so only the one that fails gets None and is ended with the error."""
        saved = [(s.generator.get_state() if s.generator is not None else None,
                  len(s.logprobs) if s.logprobs is not None else None, s.cumulative_logprob) for s in seqs]
        try:
            return self.sampler(logits[rows], seqs)
        except Exception:  # noqa: BLE001 one sequence's settings or grammar; found below
            log.exception("sampling a batch of %d failed; sampling its sequences one by one", len(seqs))
        tokens: list[int | None] = []
        for seq, r, (state, num_logprobs, cumulative) in zip(seqs, rows, saved):
            if state is not None:
                seq.generator.set_state(state)
            if num_logprobs is not None:
                del seq.logprobs[num_logprobs:]
            elif seq.logprobs is not None:
                seq.logprobs = None
            seq.cumulative_logprob = cumulative
            (token,) = self._isolated(seq, self.sampler, logits[[r]], [seq]) or (None,)
            tokens.append(token)
        return tokens

    def _isolated(self, seq: Sequence, fn, *args):
        """fn(*args) for one sequence; if it raises, that sequence's request ends with the error (None)."""
        try:
            return fn(*args)
        except Exception as e:  # noqa: BLE001 confined to the request that caused it
            log.exception("request %s failed", seq.request_id)
            self._fail(seq.request_id, f"{type(e).__name__}: {e}")
            return None

    def _fail(self, request_id: str, error: str) -> None:
        for seq in self.requests.get(request_id, []):
            if not seq.finished:
                seq.error = error
                self._finish(seq, "error")

    # Speculative decoding -----------------------------------------------------------------------------

    def _propose(self) -> None:
        spec = self.spec
        # Structured-output requests are not speculated: their grammar would have to be rolled back too.
        ready = [s for s in self.scheduler.running if s.num_tokens - s.num_computed_tokens == 1 and s.matcher is None]
        if len(ready) > spec.max_batch_size:
            # Verification would cost more than it saves. Seeded sampled requests keep speculating so that
            # their output depends only on their own history, never on what else is running.
            ready = [s for s in ready if s.generator is not None and not s.params.greedy]
        seqs, ks = [], []
        for seq in ready:
            k = self._num_drafts(seq)
            room = self.max_model_len - seq.num_tokens - 1
            if seq.params.max_tokens is not None:
                room = min(room, seq.params.max_tokens - seq.num_output_tokens - 1)
            k = min(k, room)
            if k > 0:
                seqs.append(seq)
                ks.append(k)
        if not seqs:
            return
        try:
            self.proposer.propose(seqs, ks, self.sampler)
        except Exception:  # noqa: BLE001 drafts are an optimisation: this step verifies none
            log.exception("proposing drafts failed; this step runs without them")
            for seq in seqs:
                seq.draft_tokens, seq.draft_probs = [], None
                self.proposer.release(seq)  # the draft's cache of it may be half written
            return
        self.spec_stats["draft_tokens"] += sum(len(s.draft_tokens) for s in seqs)

    def _num_drafts(self, seq: Sequence) -> int:
        spec = self.spec
        if spec.num_tokens != "auto":
            return spec.num_tokens
        k = best_num_drafts(seq.acceptance, spec.max_num_tokens, spec.verify_cost + self.draft_cost)
        if k == 0:
            seq.idle_steps += 1
            if seq.idle_steps >= 16:  # probe now and then: the text may have turned repetitive
                seq.idle_steps = 0
                return 1
        return k

    def _accept_drafts(self, seq: Sequence, rows: torch.Tensor, targets: list[int] | None) -> None:
        """rows: the target's logits at the last known token and after each draft; targets: their argmaxes,
        which decide alone for a plain greedy request."""
        drafted = len(seq.draft_tokens)
        if targets is not None:
            tokens = accept_greedy(seq.draft_tokens, targets)
        else:
            tokens = verify(rows, seq, self.sampler.generator_for(seq))
        accepted = len(tokens) - 1
        seq.num_computed_tokens += 1 + accepted  # the last known token and the accepted drafts have KV now
        self.block_manager.commit(seq)
        self.block_manager.trim(seq, seq.num_computed_tokens + 1)
        self.proposer.rollback(seq, seq.num_computed_tokens)
        seq.acceptance = 0.7 * seq.acceptance + 0.3 * accepted / drafted
        self.spec_stats["accepted_tokens"] += accepted
        self.spec_stats["verifications"] += 1
        raw = torch.log_softmax(rows.cpu(), dim=-1) if seq.params.logprobs is not None else None
        seq.draft_tokens, seq.draft_probs = [], None
        for j, token in enumerate(tokens):
            if raw is not None:
                Sampler.record_logprobs(seq, raw[j], token)
            self._append_token(seq, token)
            if seq.finished:
                break

    def _append_token(self, seq: Sequence, token: int) -> None:
        seq.token_ids.append(token)
        if seq.matcher is not None and not seq.matcher.accept_token(token):
            raise RuntimeError(f"token {token} does not continue the output's grammar")
        p = seq.params
        if seq.logprobs and self.tokenizer is not None:
            for tid, lp in seq.logprobs[-1].items():
                lp.decoded_token = self.tokenizer.decode([tid])
        delta = seq.detokenizer.add(token) if seq.detokenizer is not None else ""
        stop_token = token in p.stop_token_ids or (token in self.eos_token_ids and not p.ignore_eos)
        # A grammar that has ended (it accepted a stop token) admits nothing more: it ends the output even
        # under ignore_eos.
        stop_token = stop_token or (seq.matcher is not None and seq.matcher.is_terminated())
        out_of_room = (p.max_tokens is not None and seq.num_output_tokens >= p.max_tokens) or (
            seq.num_tokens >= self.max_model_len)
        if stop_token:
            self._finish(seq, "stop", token)
        elif delta and p.stop and self._stop_string_found(seq, len(delta)):
            pass  # finished by the check
        elif out_of_room:
            self._finish(seq, "length")

    def _stop_string_found(self, seq: Sequence, delta_len: int) -> bool:
        text = seq.detokenizer.text
        longest = max(len(s) for s in seq.params.stop)
        search_from = max(0, len(text) - delta_len - longest + 1)
        found = [(text.find(s, search_from), s) for s in seq.params.stop]
        found = [(pos, s) for pos, s in found if pos >= 0]
        if not found:
            return False
        pos, stop = min(found)
        seq.detokenizer.text = text[:pos]  # the stop string is not part of the output
        self._finish(seq, "stop", stop)
        return True

    def _finish(self, seq: Sequence, reason: str, stop_reason: int | str | None = None) -> None:
        seq.finish_reason, seq.stop_reason = reason, stop_reason
        self.scheduler.finish(seq)

    def _request_output(self, request_id: str) -> RequestOutput:
        seqs = self.requests[request_id]
        outputs = [
            CompletionOutput(
                index=s.index, text=s.text, token_ids=list(s.output_token_ids), finish_reason=s.finish_reason,
                stop_reason=s.stop_reason, logprobs=s.logprobs,
                cumulative_logprob=s.cumulative_logprob if s.logprobs is not None else None,
            )
            for s in seqs
        ]
        finished = all(s.finished for s in seqs)
        out = RequestOutput(
            request_id=request_id, prompt=self.prompts.get(request_id), prompt_token_ids=seqs[0].token_ids[
                :seqs[0].num_prompt_tokens], outputs=outputs, finished=finished,
            num_cached_tokens=max(seqs[0].num_cached_tokens, 0),
            error=next((s.error for s in seqs if s.error), None),
        )
        if finished:
            del self.requests[request_id]
            self.prompts.pop(request_id, None)
        return out

    def stats(self) -> dict:
        bm = self.block_manager
        return {
            "running": len(self.scheduler.running),
            "waiting": len(self.scheduler.waiting),
            "kv_cache_usage": bm.usage(),
            "num_kv_blocks": bm.num_blocks,
            "num_free_blocks": bm.num_free_blocks,
            "prefix_cache_queries": bm.prefix_queries,
            "prefix_cache_hits": bm.prefix_hits,
            "num_preemptions": self.scheduler.num_preemptions,
            "sleeping": self.sleep_level,
            "spec_draft_tokens": self.spec_stats["draft_tokens"],
            "spec_accepted_tokens": self.spec_stats["accepted_tokens"],
            "spec_verifications": self.spec_stats["verifications"],
        }
