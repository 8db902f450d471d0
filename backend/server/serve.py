"""python -m backend serve: run the OpenAI-compatible server under uvicorn."""

import argparse
import logging
import signal
import sys

from backend.config import EngineConfig, parse_memory


def _memory(text: str) -> float | int:
    try:
        return parse_memory(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2", help="an alias (smollm2), a Hugging Face directory or a .gguf")
    parser.add_argument("--served-model-name", default=None, help="the name clients use (default: --model)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-n", type=int, default=16, help="the most sequences one request may ask for (n)")
    parser.add_argument("--max-body-bytes", type=int, default=4 << 20,
                        help="requests with a larger body are refused with 413 before they are read")
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--num-kv-blocks", type=int, default=None)
    parser.add_argument("--kv-cache-memory", type=float, default=None,
                        help="KV-cache size: a fraction (0, 1] of free memory, or bytes when > 1")
    parser.add_argument("--gpu-memory-utilization", type=_memory, default=0.9,
                        help="CUDA: what this server may use, a fraction of the card (0.45) or a size (18GiB); the "
                             "KV cache gets what the weights and a measured warm-up leave of it")
    parser.add_argument("--enforce-eager", action="store_true", help="CUDA: no CUDA graphs for decode steps")
    parser.add_argument("--moe-gpu-experts", type=int, default=None,
                        help="MoE models larger than the card: experts per layer kept on the GPU, the rest in "
                             "pinned host memory")
    parser.add_argument("--no-prefix-caching", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--speculative", default=None,
                        help='speculative decoding as JSON, e.g. \'{"method": "ngram"}\' or '
                             '\'{"method": "draft", "model": "PATH", "num_tokens": "auto"}\'')
    parser.add_argument("--tool-call-parser", default=None, choices=["hermes", "llama3_json", "mistral"],
                        help="how tool calls are read from the model's output (default: from its chat template, "
                             "then its family)")
    parser.add_argument("--no-sleep", action="store_true",
                        help="refuse /sleep: never lend this server's GPU memory to another service")
    parser.add_argument("--shutdown-timeout", type=float, default=30.0,
                        help="seconds in-flight requests get to finish after SIGTERM before they are aborted")
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])


def serve(args: argparse.Namespace) -> int:
    import uvicorn

    from backend.loader import locate
    from backend.server.app import build_app
    from backend.spec.config import SpeculativeConfig

    memory = args.kv_cache_memory
    if memory is not None and memory > 1:
        memory = int(memory)
    config = EngineConfig(
        model=args.model, device=args.device, dtype=args.dtype, max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs, max_n=args.max_n, max_num_batched_tokens=args.max_num_batched_tokens,
        block_size=args.block_size, num_kv_blocks=args.num_kv_blocks, kv_cache_memory=memory,
        enable_prefix_caching=not args.no_prefix_caching, seed=args.seed, speculative=args.speculative,
        gpu_memory_utilization=args.gpu_memory_utilization, enforce_eager=args.enforce_eager,
        moe_gpu_experts=args.moe_gpu_experts,
    )
    # Fail at once on settings or models that are wrong, before the port is taken.
    spec = SpeculativeConfig.parse(config.speculative)
    locate(config.model)
    if spec is not None and spec.model:
        locate(spec.model)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    failure: list[str] = []
    server: uvicorn.Server | None = None

    def on_load_error(message: str) -> None:
        failure.append(message)
        if server is not None:
            server.should_exit = True

    app = build_app(config, args.served_model_name, on_load_error, allow_sleep=not args.no_sleep,
                    max_body_bytes=args.max_body_bytes, tool_call_parser=args.tool_call_parser)
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                                           timeout_graceful_shutdown=args.shutdown_timeout))
    # uvicorn re-raises the signal that stopped it once shutdown is done; a SIGTERM that led to a
    # clean shutdown should end the process with 0, so that re-raise lands on a handler that does nothing.
    signal.signal(signal.SIGTERM, lambda *_: None)
    server.run()
    if failure:
        print(f"error: could not load the model: {failure[0]}", file=sys.stderr)
        return 1
    return 0 if server.started else 1
