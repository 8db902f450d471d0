"""Settings of one engine instance (the offline LLM and the server share them)."""

from dataclasses import dataclass

KV_CACHE_DTYPES = ["auto", "float16", "bfloat16"]  # the CPU's choices of kv_cache_dtype (arithmetic.pick_kv_dtype)
ACTIVATIONS = ["float32", "int8"]  # what the CPU's quantized matmuls multiply the codes by (arithmetic.products)


@dataclass
class EngineConfig:
    model: str
    tokenizer: str | None = None  # a Hugging Face directory with the tokenizer; None: the model's own
    device: str | None = None  # None: cuda when available, else cpu
    dtype: str = "auto"
    # the model's; on the CPU float16 or bfloat16 halve the cache (arithmetic.pick_kv_dtype)
    kv_cache_dtype: str = "auto"
    # CPU, a GGUF kept in its blocks: "int8" quantizes x per group for integer products, as llama.cpp does
    # (arithmetic.products)
    activations: str = "float32"
    max_num_seqs: int = 64
    max_n: int = 16  # sequences one request may ask for (its n)
    # sequences (prompts x n) one /v1/completions request may ask for: a list of 1,000 prompts would otherwise
    # queue 1,000 sequences at once
    max_prompts: int = 128
    # tokens one embeddings request may hold, all its inputs together; None: 65,536, or max_model_len if longer
    max_embedding_tokens: int | None = None
    max_model_len: int | None = None  # None: the model's context length, capped at 8192 (backend.context_length)
    # None: the model file's own; "none": no scaling; "yarn", "yarn:4" or a dict: RoPE scaled to serve past the
    # trained length. Unset, a max_model_len past it switches YaRN on with the factor it needs (backend.context_length).
    rope_scaling: dict | str | None = None
    max_num_batched_tokens: int | None = None  # None: 2048, or max_model_len if smaller
    # While any sequence decodes, at most this many prompt tokens (prompts and embedding inputs together) a step,
    # under what step_time_budget gives; None: no cap but the time budget's (256 on the CPU until a step was timed)
    long_prefill_token_threshold: int | None = None
    # Seconds a step may take while any sequence decodes or waits for its first chunk: the prompt work beside them is
    # sized from the measured cost of a prompt token (backend/engine/step_budget.py); a prompt computed alone takes
    # steps four times as long. None: 0.25 on the CPU, 0.05 on CUDA.
    step_time_budget: float | None = None
    block_size: int = 16
    num_kv_blocks: int | None = None  # an exact KV-cache size in blocks; overrides kv_cache_memory
    kv_cache_memory: float | int | None = None  # a fraction (0, 1] of free memory, or bytes
    enable_prefix_caching: bool = True
    # Prefix-cache blocks kept on disk across restarts and model swaps, in bytes, least recently used out, under
    # $SCRIPTORIUM_HOME/cache/kv (engine/disk_prefix_cache.py); 0: none written or read
    disk_cache_bytes: int = 4 << 30
    seed: int = 0
    speculative: dict | str | None = None  # see backend.spec.speculative_config.SpeculativeConfig
    # CUDA: what this engine may use (weights, activations, KV cache): a fraction (0, 1] of the card, or bytes.
    gpu_memory_utilization: float | int = 0.9
    enforce_eager: bool = False  # CUDA: no CUDA graphs for decode steps
    # MoE experts per layer kept on the device, the rest in host memory; "auto": the most that fit the budget
    moe_gpu_experts: int | str | None = None
    # with moe_gpu_experts: the experts in host memory computed there by the CPU's kernels for the tokens routed to
    # them (llama.cpp's --n-cpu-moe way), not copied to the device (backend/models/split_experts.py)
    moe_cpu_compute: bool = False
    # None: the checkpoint's own format (a GGUF stays quantized); "dequantize": a GGUF expanded to dtype at load
    quantization: str | None = None
    # Structured output: the largest JSON schema compiled (as JSON text), and how long the server waits for a
    # compile before refusing the request (the compile goes on, and its grammar is kept for the next one)
    max_schema_bytes: int = 256 << 10
    grammar_compile_timeout: float = 30.0

    def __post_init__(self) -> None:
        from backend.context_length import check_rope_scaling

        self.rope_scaling = check_rope_scaling(self.rope_scaling)
        for name in ("max_num_seqs", "max_n", "max_prompts", "max_model_len", "max_num_batched_tokens", "block_size",
                     "long_prefill_token_threshold", "num_kv_blocks", "max_schema_bytes", "max_embedding_tokens"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        u = self.gpu_memory_utilization
        if isinstance(u, bool) or not ((isinstance(u, float) and 0 < u <= 1) or (isinstance(u, int) and u > 1)):
            raise ValueError(f"gpu_memory_utilization must be a fraction in (0, 1] or a number of bytes, got {u!r}")
        g = self.moe_gpu_experts
        if g is not None and g != "auto" and (isinstance(g, bool) or not isinstance(g, int) or g < 1):
            raise ValueError(f"moe_gpu_experts must be an integer >= 1 or 'auto', got {g!r}")
        if self.moe_cpu_compute and g is None:
            raise ValueError("moe_cpu_compute computes the experts kept in host memory on the CPU; it needs "
                             "moe_gpu_experts (a count per layer, or 'auto') to say which stay on the device")
        if self.step_time_budget is not None and not self.step_time_budget > 0:
            raise ValueError(f"step_time_budget must be > 0 seconds, got {self.step_time_budget!r}")
        if not self.grammar_compile_timeout > 0:
            raise ValueError(f"grammar_compile_timeout must be > 0 seconds, got {self.grammar_compile_timeout!r}")
        d = self.disk_cache_bytes
        if isinstance(d, bool) or not isinstance(d, int) or d < 0:
            raise ValueError(f"disk_cache_bytes must be a number of bytes >= 0 (0: no disk cache), got {d!r}")
        m = self.kv_cache_memory
        if m is not None and not ((isinstance(m, float) and 0 < m <= 1) or (isinstance(m, int) and m > 0)):
            raise ValueError(f"kv_cache_memory must be a fraction in (0, 1] or a number of bytes, got {m!r}")
