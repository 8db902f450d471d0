"""Settings of one engine instance (the offline LLM and the server share them).

Each field is declared once, here: its name, type, default and help make the flags of `python -m backend serve`
and `generate` and the fields of EngineArgs (backend/config_flags.py), so a new setting is one new field."""

from dataclasses import Field, dataclass, field

from backend import flag_types

# the CPU's choices of kv_cache_dtype (arithmetic.pick_kv_dtype)
KV_CACHE_DTYPES = ["auto", "float16", "bfloat16"]
# what the CPU's quantized matmuls multiply the codes by (arithmetic.products)
ACTIVATIONS = ["float32", "int8"]


def setting(default, help: str, **flag) -> Field:
    """A field with its flag's help; `flag` may give the flag's type= (how its text is read, where the annotation
    does not say), choices= and flag= (its name, where not --the-field-name)."""
    return field(default=default, metadata={"help": help, **flag})


@dataclass
class EngineConfig:
    model: str
    tokenizer: str | None = setting(
        None, "a Hugging Face directory with the tokenizer (default: the model's own)"
    )
    device: str | None = setting(None, "cpu or cuda (default: cuda when available)")
    dtype: str = setting(
        "auto",
        "auto (CPU: float32, exact; CUDA: the checkpoint's), float32, bfloat16 (CPU with AMX: bf16 products for "
        "batches and prompts, about 1.6x the throughput), float16",
    )
    kv_cache_dtype: str = setting(
        "auto",
        "auto: the model's dtype; CPU (float32): float16 or bfloat16 halve the KV cache and what attention reads "
        "a step (long contexts decode faster; keys and values rounded once, when stored; bfloat16 keeps fp32's "
        "range, float16 more precision)",
        choices=KV_CACHE_DTYPES,
    )
    activations: str = setting(
        "float32",
        "CPU, a GGUF kept in its blocks: int8 quantizes each row of x per block of 16 or 32 to 8 bits and "
        "multiplies the codes in integers, as llama.cpp does (2-3x the matmul speed with AVX-512 VNNI; no longer "
        "exact against transformers)",
        choices=ACTIVATIONS,
    )
    max_num_seqs: int = setting(64, "the most sequences decoded together")
    max_n: int = setting(16, "the most sequences one request may ask for (n)")
    # without it a list of 1,000 prompts would queue 1,000 sequences at once
    max_prompts: int = setting(
        128, "the most sequences (prompts times n) one /v1/completions request may ask for"
    )
    max_embedding_tokens: int | None = setting(
        None,
        "the most tokens one /v1/embeddings request may hold, all its inputs together (default: 65536, or "
        "--max-model-len if longer); more is refused with a 400 naming this limit",
    )
    # backend.context_length
    max_model_len: int | None = setting(
        None,
        "the longest prompt plus completion (default: the model's context, at most 8192; smollm2: 32768, YaRN "
        "x4); past the model's trained length RoPE is scaled by YaRN with the factor it needs (65536 on "
        "smollm2: x8), unless --rope-scaling says otherwise",
    )
    # None: the file's own; "none", "yarn", "yarn:4" or a dict as backend.context_length reads them
    rope_scaling: dict | str | None = setting(
        None,
        "RoPE scaling, overriding the model file's own: yarn (the factor --max-model-len needs, else 4), "
        'yarn:FACTOR, linear:FACTOR, JSON such as \'{"rope_type": "yarn", "factor": 4}\', or none (no scaling, '
        "even where the file has some)",
        type=flag_types.rope_scaling,
    )
    max_num_batched_tokens: int | None = setting(
        None, "the most tokens one step computes (default: 2048, or --max-model-len if smaller)"
    )
    long_prefill_token_threshold: int | None = setting(
        None,
        "while any stream decodes, at most this many prompt tokens a step (prompts and embedding inputs "
        "together), under what --step-time-budget gives (default: no cap but the time budget's; 256 on the CPU "
        "until a step has been measured)",
    )
    # backend/engine/step_budget.py
    step_time_budget: float | None = setting(
        None,
        "seconds a step may take while any stream decodes or a request waits for its first token: the prompt "
        "and embedding work beside them is sized from the measured cost of a token, and shared by the prompts "
        "under way and the requests starting (default: 0.25 on the CPU, 0.05 on CUDA; a prompt alone takes "
        "steps four times as long)",
    )
    block_size: int = setting(16, "tokens per KV-cache block")
    num_kv_blocks: int | None = setting(None, "an exact KV-cache size in blocks; overrides --kv-cache-memory")
    kv_cache_memory: float | int | None = setting(
        None,
        "KV-cache size: a fraction (0, 1] of free memory, or bytes when > 1",
        type=flag_types.fraction_or_bytes,
    )
    enable_prefix_caching: bool = setting(
        True, "no prefix cache: every prompt computed in full", flag="--no-prefix-caching"
    )
    # engine/disk_prefix_cache.py
    disk_cache_bytes: int = setting(
        4 << 30,
        "prompts kept across restarts: finished prompts' KV blocks written under $SCRIPTORIUM_HOME/cache/kv, up "
        "to this size (e.g. 4GiB, the default), least recently used out, and loaded instead of recomputed on a "
        "later prefix hit; 0: off",
        type=flag_types.disk_size,
    )
    seed: int = setting(0, "the seed of the sampling of requests that give none")
    # backend.speculative.speculative_config.SpeculativeConfig
    speculative: dict | str | None = setting(
        None,
        'speculative decoding as JSON, e.g. \'{"method": "ngram"}\' or \'{"method": "draft", "model": "PATH", '
        '"num_tokens": "auto"}\'',
        type=str,
    )
    gpu_memory_utilization: float | int = setting(
        0.9,
        "CUDA: what this engine may use, a fraction of the card (0.45) or a size (18GiB); the KV cache gets what "
        "the weights and a measured warm-up leave of it",
        type=flag_types.memory,
    )
    enforce_eager: bool = setting(False, "CUDA: no CUDA graphs for decode steps")
    moe_gpu_experts: int | str | None = setting(
        None,
        "MoE models larger than the card: experts per layer kept on the GPU, the rest in pinned host memory; "
        "'auto': the most that fit --gpu-memory-utilization",
        type=flag_types.experts,
    )
    # backend/models/split_experts.py
    moe_cpu_compute: bool = setting(
        False,
        "with --moe-gpu-experts: compute the experts kept in host memory on the CPU (as llama.cpp's --n-cpu-moe "
        "does) instead of copying them to the GPU when routed to",
    )
    quantization: str | None = setting(
        None,
        "int8/int4: quantize a Hugging Face checkpoint's linear layers at load (weight-only, groups of 32); "
        "dequantize: expand a GGUF's weights at load (default: the file's own)",
        choices=["int8", "int4", "dequantize"],
    )
    # the compile goes on after the timeout, and its grammar is kept for the next request
    max_schema_bytes: int = setting(
        256 << 10, "the largest JSON schema (response_format, guided_json, tools) compiled, in bytes"
    )
    grammar_compile_timeout: float = setting(
        30.0, "seconds a request waits for its JSON schema to compile before it is refused"
    )

    def __post_init__(self) -> None:
        from backend.context_length import check_rope_scaling

        self.rope_scaling = check_rope_scaling(self.rope_scaling)
        for name in (
            "max_num_seqs",
            "max_n",
            "max_prompts",
            "max_model_len",
            "max_num_batched_tokens",
            "block_size",
            "long_prefill_token_threshold",
            "num_kv_blocks",
            "max_schema_bytes",
            "max_embedding_tokens",
        ):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        u = self.gpu_memory_utilization
        if isinstance(u, bool) or not (
            (isinstance(u, float) and 0 < u <= 1) or (isinstance(u, int) and u > 1)
        ):
            raise ValueError(
                f"gpu_memory_utilization must be a fraction in (0, 1] or a number of bytes, got {u!r}"
            )
        g = self.moe_gpu_experts
        if g is not None and g != "auto" and (isinstance(g, bool) or not isinstance(g, int) or g < 1):
            raise ValueError(f"moe_gpu_experts must be an integer >= 1 or 'auto', got {g!r}")
        if self.moe_cpu_compute and g is None:
            raise ValueError(
                "moe_cpu_compute computes the experts kept in host memory on the CPU; it needs "
                "moe_gpu_experts (a count per layer, or 'auto') to say which stay on the device"
            )
        if self.step_time_budget is not None and not self.step_time_budget > 0:
            raise ValueError(f"step_time_budget must be > 0 seconds, got {self.step_time_budget!r}")
        if not self.grammar_compile_timeout > 0:
            raise ValueError(
                f"grammar_compile_timeout must be > 0 seconds, got {self.grammar_compile_timeout!r}"
            )
        d = self.disk_cache_bytes
        if isinstance(d, bool) or not isinstance(d, int) or d < 0:
            raise ValueError(f"disk_cache_bytes must be a number of bytes >= 0 (0: no disk cache), got {d!r}")
        m = self.kv_cache_memory
        if m is not None and not ((isinstance(m, float) and 0 < m <= 1) or (isinstance(m, int) and m > 0)):
            raise ValueError(f"kv_cache_memory must be a fraction in (0, 1] or a number of bytes, got {m!r}")
