"""python -m backend serve: run the OpenAI-compatible server under uvicorn."""

import argparse
import json
import logging
import signal
import sys
from dataclasses import fields
from typing import TYPE_CHECKING

from backend.config import ACTIVATIONS, KV_CACHE_DTYPES, EngineConfig
from backend.context_length import serving_config
from common.sizes import parse_memory

if TYPE_CHECKING:
    from backend.server.state import RequestPolicy


def _memory(text: str) -> float | int:
    try:
        return parse_memory(text)  # the forms compose.yaml's x-ops gpu_memory takes, so ops passes it as written
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _disk_size(text: str) -> int:
    size = _memory(text)
    if isinstance(size, float):  # parse_memory reads a bare number up to 1 as a fraction of a card
        if size == 0:
            return 0
        raise argparse.ArgumentTypeError(f"{text!r} is not a size; give bytes with a unit, such as 4GiB, or 0 (off)")
    return size


def _budget(text: str) -> float | int | str:
    return text if text == "auto" else _memory(text)


def rope_scaling_arg(text: str) -> dict | str:
    from backend.context_length import parse_rope_scaling

    try:
        return parse_rope_scaling(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _experts(text: str) -> int | str:
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of experts; give an integer >= 1 or 'auto'") from None


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """How a model runs: what `serve` and `generate` both take."""
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    parser.add_argument("--dtype", default="auto",
                        help="auto (CPU: float32, exact; CUDA: the checkpoint's), float32, bfloat16 (CPU with AMX: "
                             "bf16 products for batches and prompts, about 1.6x the throughput), float16")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                        help="auto: the model's dtype; CPU (float32): float16 or bfloat16 halve the KV cache and what "
                             "attention reads a step (long contexts decode faster; keys and values rounded once, when "
                             "stored; bfloat16 keeps fp32's range, float16 more precision)")
    parser.add_argument("--activations", default="float32", choices=ACTIVATIONS,
                        help="CPU, a GGUF kept in its blocks: int8 quantizes each row of x per block of 16 or 32 to "
                             "8 bits and multiplies the codes in integers, as llama.cpp does (2-3x the matmul speed "
                             "with AVX-512 VNNI; no longer exact against transformers)")
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="the longest prompt plus completion (default: the model's context, at most 8192; "
                             "smollm2: 32768, YaRN x4); past the model's trained length RoPE is scaled by YaRN with "
                             "the factor it needs (65536 on smollm2: x8), unless --rope-scaling says otherwise")
    parser.add_argument("--rope-scaling", type=rope_scaling_arg, default=None,
                        help="RoPE scaling, overriding the model file's own: yarn (the factor --max-model-len needs, "
                             "else 4), yarn:FACTOR, linear:FACTOR, JSON such as '{\"rope_type\": \"yarn\", "
                             "\"factor\": 4}', or none (no scaling, even where the file has some)")
    parser.add_argument("--quantization", default=None, choices=["int8", "int4", "dequantize"],
                        help="int8/int4: quantize a Hugging Face checkpoint's linear layers at load (weight-only, "
                             "groups of 32); dequantize: expand a GGUF's weights at load (default: the file's own)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                        help="the model, as `vllm serve MODEL` takes it: the same as a first --model")
    parser.add_argument("--model", action="append", default=None,
                        help="an alias (smollm2), a Hugging Face directory or a .gguf, optionally as NAME=MODEL (the "
                             "name clients use); repeat for several models behind one server: the first loads at "
                             "start-up, the others on first use (default: smollm2)")
    parser.add_argument("--served-model-name", default=None,
                        help="the name clients use for a single --model (default: --model)")
    parser.add_argument("--model-alias", action="append", default=[], metavar="PATTERN=NAME",
                        help="requests for a model matching PATTERN (a glob: 'claude-*') go to the model served as NAME; "
                             "repeatable, the first match wins (Claude Code asks for its own model names)")
    parser.add_argument("--api-key", default=None,
                        help="every /v1 request must carry this key (Authorization: Bearer KEY, or x-api-key: KEY)")
    parser.add_argument("--max-loaded-models", type=int, default=None,
                        help="several models: how many may be loaded at once; the least recently used idle one is "
                             "unloaded to make room (default: no limit)")
    parser.add_argument("--models-memory", type=_memory, default=None,
                        help="several models: the bytes (e.g. 40GiB) their weights and KV caches may hold together; "
                             "the least recently used idle ones are unloaded to make room (default: no limit)")
    parser.add_argument("--load-timeout", type=float, default=60.0,
                        help="seconds a request waits for its model to load before a 503 with Retry-After")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    add_model_arguments(parser)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-n", type=int, default=16, help="the most sequences one request may ask for (n)")
    parser.add_argument("--max-schema-bytes", type=int, default=256 << 10,
                        help="the largest JSON schema (response_format, guided_json, tools) compiled, in bytes")
    parser.add_argument("--grammar-compile-timeout", type=float, default=30.0,
                        help="seconds a request waits for its JSON schema to compile before it is refused")
    parser.add_argument("--max-prompts", type=int, default=128,
                        help="the most sequences (prompts times n) one /v1/completions request may ask for")
    parser.add_argument("--max-embedding-tokens", type=int, default=None,
                        help="the most tokens one /v1/embeddings request may hold, all its inputs together (default: "
                             "65536, or --max-model-len if longer); more is refused with a 400 naming this limit")
    parser.add_argument("--engine-stuck-after", type=float, default=300.0,
                        help="seconds an engine step or engine call may run before /health answers 503 saying the "
                             "engine is stuck (so `ops health` restarts it); well above the slowest real step")
    parser.add_argument("--max-body-bytes", type=int, default=4 << 20,
                        help="requests with a larger body are refused with 413 before they are read")
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument("--long-prefill-token-threshold", type=int, default=None,
                        help="while any stream decodes, at most this many prompt tokens a step (prompts and "
                             "embedding inputs together), under what --step-time-budget gives (default: no cap "
                             "but the time budget's; 256 on the CPU until a step has been measured)")
    parser.add_argument("--step-time-budget", type=float, default=None,
                        help="seconds a step may take while any stream decodes or a request waits for its first "
                             "token: the prompt and embedding work beside them is sized from the measured cost of a "
                             "token, and shared by the prompts under way and the requests starting (default: 0.25 "
                             "on the CPU, 0.05 on CUDA; a prompt alone takes steps four times as long)")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--num-kv-blocks", type=int, default=None)
    parser.add_argument("--kv-cache-memory", type=float, default=None,
                        help="KV-cache size: a fraction (0, 1] of free memory, or bytes when > 1")
    parser.add_argument("--gpu-memory-utilization", type=_budget, default=0.9,
                        help="CUDA: what this server may use, a fraction of the card (0.45) or a size (18GiB); the "
                             "KV cache gets what the weights and a measured warm-up leave of it; 'auto': what its "
                             "largest model needs (--print-memory-need)")
    parser.add_argument("--print-memory-need", action="store_true",
                        help="print as JSON the GPU memory this server needs (its largest model's weights, smallest "
                             "KV cache and activations) and exit; ops' plan budgets the backend with it")
    parser.add_argument("--enforce-eager", action="store_true", help="CUDA: no CUDA graphs for decode steps")
    parser.add_argument("--moe-gpu-experts", type=_experts, default=None,
                        help="MoE models larger than the card: experts per layer kept on the GPU, the rest in "
                             "pinned host memory; 'auto': the most that fit --gpu-memory-utilization")
    parser.add_argument("--moe-cpu-compute", action="store_true",
                        help="with --moe-gpu-experts: compute the experts kept in host memory on the CPU (as "
                             "llama.cpp's --n-cpu-moe does) instead of copying them to the GPU when routed to")
    parser.add_argument("--no-prefix-caching", action="store_true")
    parser.add_argument("--disk-cache-bytes", type=_disk_size, default=4 << 30,
                        help="prompts kept across restarts: finished prompts' KV blocks written under "
                             "$SCRIPTORIUM_HOME/cache/kv, up to this size (e.g. 4GiB, the default), least recently "
                             "used out, and loaded instead of recomputed on a later prefix hit; 0: off")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--speculative", default=None,
                        help='speculative decoding as JSON, e.g. \'{"method": "ngram"}\' or '
                             '\'{"method": "draft", "model": "PATH", "num_tokens": "auto"}\'')
    parser.add_argument("--tool-call-parser", default=None, choices=["hermes", "llama3_json", "mistral"],
                        help="how tool calls are read from the model's output (default: from its chat template, "
                             "then its family)")
    parser.add_argument("--reasoning-parser", default="auto", choices=["auto", "none", "think"],
                        help="how the model's reasoning is told from its answer (reasoning_content, thinking blocks, "
                             "reasoning items): auto (a chat template that writes </think>: think), none (all of the "
                             "output is the answer), think (<think>...</think>)")
    parser.add_argument("--max-tokens-past-context", default="clamp", choices=["clamp", "refuse"],
                        help="a max_tokens the context cannot hold, on every API: clamp (cut to what the prompt "
                             "leaves, said in the x-max-tokens-clamped header; agent clients ask for 32k-64k) or "
                             "refuse (vLLM's 400 context_length_exceeded)")
    parser.add_argument("--keep-attribution-header", action="store_true",
                        help="keep Claude Code's per-request `x-anthropic-billing-header:` line in the prompt "
                             "(dropped by default: it differs every request and would defeat the prefix cache)")
    parser.add_argument("--no-sleep", action="store_true",
                        help="refuse /sleep: never lend this server's GPU memory to another service")
    parser.add_argument("--shutdown-timeout", type=float, default=30.0,
                        help="seconds in-flight requests get to finish after SIGTERM before they are aborted")
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])


def named_models(models: list[str] | None, served_model_name: str | None) -> list[tuple[str, str]]:
    """--model values as (name, model): NAME=MODEL, or the model itself (its alias or path) as the name."""
    pairs = []
    for value in models or ["smollm2"]:
        name, sep, model = value.partition("=")
        pairs.append((name, model) if sep and name and "/" not in name else (value, value))
    if served_model_name is not None:
        if len(pairs) > 1:
            raise ValueError("--served-model-name names a single --model; with several, write --model NAME=MODEL")
        pairs = [(served_model_name, pairs[0][1])]
    names = [name for name, _ in pairs]
    for name in names:
        if names.count(name) > 1:
            raise ValueError(f"two --model options are served as {name!r}; name them apart with --model NAME=MODEL")
    return pairs


def model_aliases(values: list[str], names: list[str]) -> list[tuple[str, str]]:
    """--model-alias values as (pattern, name), each name one the server serves."""
    aliases = []
    for value in values:
        pattern, sep, name = value.rpartition("=")
        if not sep or not pattern or not name:
            raise ValueError(f"--model-alias {value!r}: write PATTERN=NAME, e.g. 'claude-*=smollm2'")
        if name not in names:
            raise ValueError(f"--model-alias {value!r}: {name!r} is not a served model; served: {', '.join(names)}")
        aliases.append((pattern, name))
    return aliases


def request_policy(args: argparse.Namespace) -> "RequestPolicy":
    from backend.server.state import RequestPolicy

    return RequestPolicy(args.tool_call_parser, args.max_tokens_past_context, args.keep_attribution_header,
                         reasoning_parser=args.reasoning_parser)


def _engine_config(args: argparse.Namespace, model: str, gpu_memory: float | int) -> EngineConfig:
    """The engine's settings from the flags that carry EngineConfig's names (one declaration: config.py)."""
    memory = args.kv_cache_memory
    if memory is not None and memory > 1:
        memory = int(memory)
    named = {f.name: getattr(args, f.name) for f in fields(EngineConfig) if hasattr(args, f.name)}
    return EngineConfig(**{**named, "model": model, "kv_cache_memory": memory, "gpu_memory_utilization": gpu_memory,
                           "enable_prefix_caching": not args.no_prefix_caching})


def serve(args: argparse.Namespace) -> int:
    """Settings or models that are wrong raise ValueError, ModelLoadError or ModelStoreError: `python -m backend`
    prints them as `error: ...` and exits with 2, before the port is taken."""
    models = named_models([*([args.model_tag] if args.model_tag else []), *(args.model or [])] or None,
                          args.served_model_name)
    aliases = model_aliases(args.model_alias, [name for name, _ in models])
    if args.max_loaded_models is not None and args.max_loaded_models < 1:
        raise ValueError("--max-loaded-models must be at least 1")
    if isinstance(args.models_memory, float):
        raise ValueError("--models-memory is a size, such as 40GiB or 512MiB")
    if args.print_memory_need or args.gpu_memory_utilization == "auto":
        from backend.server.memory_need import server_need

        need = server_need(_engine_config(args, models[0][1], 0.9), models, args.models_memory)
        if args.print_memory_need:
            print(json.dumps(need))
            return 0
        args.gpu_memory_utilization = need["need_bytes"]
    base = _engine_config(args, models[0][1], args.gpu_memory_utilization)
    config = serving_config(base, models[0][1])
    import torch
    import uvicorn

    from backend.arithmetic import pick_dtype
    from backend.loader import locate
    from backend.server.app import build_app
    from backend.server.registry import Budget
    from backend.server.shutdown import EndingServer
    from backend.spec.speculative_config import SpeculativeConfig

    spec = SpeculativeConfig.parse(config.speculative)
    for _, model in models:
        locate(model)
    if spec is not None and spec.model:
        locate(spec.model)
    cuda = config.device.startswith("cuda") if config.device is not None else torch.cuda.is_available()
    if config.dtype != "auto":  # what no model makes right (float16 on the CPU); the rest is checked at load
        pick_dtype(config.dtype, torch.device("cuda" if cuda else "cpu"), None)
    if len(models) > 1 and cuda and config.kv_cache_memory is None and config.num_kv_blocks is None:
        # Sized from what the card has left, the first model's KV cache would leave none for the next.
        raise ValueError("several models on a GPU need a KV cache of a fixed size each: pass --kv-cache-memory "
                         "(e.g. 4GiB) or --num-kv-blocks")
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    failure: list[str] = []
    server: uvicorn.Server | None = None

    def on_load_error(message: str) -> None:
        failure.append(message)
        if server is not None:
            server.should_exit = True

    more = [(name, serving_config(base, model)) for name, model in models[1:]]
    if args.engine_stuck_after <= 0:
        raise ValueError("--engine-stuck-after must be a number of seconds > 0")
    budget = Budget(args.max_loaded_models, args.models_memory, args.load_timeout, args.engine_stuck_after)
    app = build_app(config, models[0][0], on_load_error, allow_sleep=not args.no_sleep,
                    max_body_bytes=args.max_body_bytes, policy=request_policy(args), more_models=more,
                    budget=budget, api_key=args.api_key, model_aliases=aliases)
    server = EndingServer(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                                         timeout_graceful_shutdown=args.shutdown_timeout), app.state.registry)
    # uvicorn re-raises the signal that stopped it once shutdown is done; a SIGTERM that led to a
    # clean shutdown should end the process with 0, so that re-raise lands on a handler that does nothing.
    signal.signal(signal.SIGTERM, lambda *_: None)
    server.run()
    if failure:
        print(f"error: could not load the model: {failure[0]}", file=sys.stderr)
        return 1
    return 0 if server.started else 1
