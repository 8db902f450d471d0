"""python -m backend serve: run the OpenAI-compatible server under uvicorn."""

import argparse
import json
import logging
import signal
import sys
from typing import TYPE_CHECKING

from backend.config import EngineConfig
from backend.config_flags import engine_settings
from backend.context_length import serving_config
from backend.server.serve_flags import SERVE_OWN

if TYPE_CHECKING:
    from backend.server.state import RequestPolicy


def named_models(models: list[str] | None, served_model_name: str | None) -> list[tuple[str, str]]:
    """--model values as (name, model): NAME=MODEL, or the model itself (its alias or path) as the name."""
    pairs = []
    for value in models or ["smollm2"]:
        name, sep, model = value.partition("=")
        pairs.append((name, model) if sep and name and "/" not in name else (value, value))
    if served_model_name is not None:
        if len(pairs) > 1:
            raise ValueError(
                "--served-model-name names a single --model; with several, write --model NAME=MODEL"
            )
        pairs = [(served_model_name, pairs[0][1])]
    names = [name for name, _ in pairs]
    for name in names:
        if names.count(name) > 1:
            raise ValueError(
                f"two --model options are served as {name!r}; name them apart with --model NAME=MODEL"
            )
    return pairs


def model_aliases(values: list[str], names: list[str]) -> list[tuple[str, str]]:
    """--model-alias values as (pattern, name), each name one the server serves."""
    aliases = []
    for value in values:
        pattern, sep, name = value.rpartition("=")
        if not sep or not pattern or not name:
            raise ValueError(f"--model-alias {value!r}: write PATTERN=NAME, e.g. 'claude-*=smollm2'")
        if name not in names:
            raise ValueError(
                f"--model-alias {value!r}: {name!r} is not a served model; served: {', '.join(names)}"
            )
        aliases.append((pattern, name))
    return aliases


def request_policy(args: argparse.Namespace) -> "RequestPolicy":
    from backend.server.state import RequestPolicy

    return RequestPolicy(
        args.tool_call_parser,
        args.max_tokens_past_context,
        args.keep_attribution_header,
        reasoning_parser=args.reasoning_parser,
        stream_keepalive=args.stream_keepalive,
    )


def _engine_config(args: argparse.Namespace, model: str, gpu_memory: float | int) -> EngineConfig:
    """The engine's settings from the flags add_engine_arguments made (backend/config_flags.py)."""
    return EngineConfig(
        **{**engine_settings(args, SERVE_OWN), "model": model, "gpu_memory_utilization": gpu_memory}
    )


def serve(args: argparse.Namespace) -> int:
    """Settings or models that are wrong raise ValueError, ModelLoadError or ModelStoreError: `python -m backend`
    prints them as `error: ...` and exits with 2, before the port is taken."""
    models = named_models(
        [*([args.model_tag] if args.model_tag else []), *(args.model or [])] or None, args.served_model_name
    )
    aliases = model_aliases(args.model_alias, [name for name, _ in models])
    if args.tokenizer is not None and len(models) > 1:
        raise ValueError("--tokenizer is the tokenizer of a single --model; with several, each uses its own")
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
    from backend.speculative.speculative_config import SpeculativeConfig

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
        raise ValueError(
            "several models on a GPU need a KV cache of a fixed size each: pass --kv-cache-memory "
            "(e.g. 4GiB) or --num-kv-blocks"
        )
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
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
    app = build_app(
        config,
        models[0][0],
        on_load_error,
        allow_sleep=not args.no_sleep,
        max_body_bytes=args.max_body_bytes,
        policy=request_policy(args),
        more_models=more,
        budget=budget,
        api_key=args.api_key,
        model_aliases=aliases,
    )
    server = EndingServer(
        uvicorn.Config(
            app,
            host=args.host,
            port=args.port,
            log_level=args.log_level,
            timeout_graceful_shutdown=args.shutdown_timeout,
        ),
        app.state.registry,
    )
    # uvicorn re-raises the signal that stopped it once shutdown is done; a SIGTERM that led to a
    # clean shutdown should end the process with 0, so that re-raise lands on a handler that does nothing.
    signal.signal(signal.SIGTERM, lambda *_: None)
    server.run()
    if failure:
        print(f"error: could not load the model: {failure[0]}", file=sys.stderr)
        return 1
    return 0 if server.started else 1
