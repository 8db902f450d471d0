"""The flags of `python -m backend serve`: the server's own, declared here, and a flag for each engine setting,
made from EngineConfig (backend/config_flags.py)."""

import argparse

from backend import flag_types
from backend.config_flags import add_engine_arguments, setting_help

SERVE_OWN = ("model",)  # EngineConfig's fields whose flags serve declares itself: --model takes several
# serve's budget may also be measured from its models
SERVE_CHANGES = {
    "gpu_memory_utilization": {
        "type": flag_types.memory_or_auto,
        "help": setting_help("gpu_memory_utilization")
        + "; 'auto': what its largest model needs (--print-memory-need)",
    }
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "model_tag",
        nargs="?",
        default=None,
        metavar="MODEL",
        help="the model, as `vllm serve MODEL` takes it: the same as a first --model",
    )
    parser.add_argument(
        "--model",
        action="append",
        default=None,
        help="an alias (smollm2), a Hugging Face directory or a .gguf, optionally as NAME=MODEL (the "
        "name clients use); repeat for several models behind one server: the first loads at "
        "start-up, the others on first use (default: smollm2)",
    )
    parser.add_argument(
        "--served-model-name",
        default=None,
        help="the name clients use for a single --model (default: --model)",
    )
    parser.add_argument(
        "--model-alias",
        action="append",
        default=[],
        metavar="PATTERN=NAME",
        help="requests for a model matching PATTERN (a glob: 'claude-*') go to the model served as NAME; "
        "repeatable, the first match wins (Claude Code asks for its own model names)",
    )
    parser.add_argument(
        "--api-key",
        default=None,
        help="every /v1 request must carry this key (Authorization: Bearer KEY, or x-api-key: KEY)",
    )
    parser.add_argument(
        "--max-loaded-models",
        type=int,
        default=None,
        help="several models: how many may be loaded at once; the least recently used idle one is "
        "unloaded to make room (default: no limit)",
    )
    parser.add_argument(
        "--models-memory",
        type=flag_types.memory,
        default=None,
        help="several models: the bytes (e.g. 40GiB) their weights and KV caches may hold together; "
        "the least recently used idle ones are unloaded to make room (default: no limit)",
    )
    parser.add_argument(
        "--load-timeout",
        type=float,
        default=60.0,
        help="seconds a request waits for its model to load before a 503 with Retry-After",
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    add_engine_arguments(parser, SERVE_OWN, SERVE_CHANGES)
    parser.add_argument(
        "--engine-stuck-after",
        type=float,
        default=300.0,
        help="seconds an engine step or engine call may run before /health answers 503 saying the "
        "engine is stuck (so `ops health` restarts it); well above the slowest real step",
    )
    parser.add_argument(
        "--max-body-bytes",
        type=int,
        default=4 << 20,
        help="requests with a larger body are refused with 413 before they are read",
    )
    parser.add_argument(
        "--print-memory-need",
        action="store_true",
        help="print as JSON the GPU memory this server needs (its largest model's weights, smallest "
        "KV cache and activations) and exit; ops' plan budgets the backend with it",
    )
    parser.add_argument(
        "--tool-call-parser",
        default=None,
        choices=["hermes", "llama3_json", "mistral"],
        help="how tool calls are read from the model's output (default: from its chat template, "
        "then its family)",
    )
    parser.add_argument(
        "--reasoning-parser",
        default="auto",
        choices=["auto", "none", "think", "harmony"],
        help="how the model's reasoning is told from its answer (reasoning_content, thinking blocks, "
        "reasoning items): auto (a chat template that writes </think>: think; one that writes "
        "<|channel|>: harmony), none (all of the output is the answer), think (<think>...</think>), "
        "harmony (gpt-oss's channels)",
    )
    parser.add_argument(
        "--max-tokens-past-context",
        default="clamp",
        choices=["clamp", "refuse"],
        help="a max_tokens the context cannot hold, on every API: clamp (cut to what the prompt "
        "leaves, said in the x-max-tokens-clamped header; agent clients ask for 32k-64k) or "
        "refuse (vLLM's 400 context_length_exceeded)",
    )
    parser.add_argument(
        "--keep-attribution-header",
        action="store_true",
        help="keep Claude Code's per-request `x-anthropic-billing-header:` line in the prompt "
        "(dropped by default: it differs every request and would defeat the prefix cache)",
    )
    parser.add_argument(
        "--stream-keepalive",
        type=float,
        default=60.0,
        metavar="SECONDS",
        help="a /v1/messages, /v1/responses or /v1/chat/completions stream that has sent no content for "
        "this long (a long prompt being processed) sends an empty one: agents' watchdogs count "
        "events, not pings (0: never)",
    )
    parser.add_argument(
        "--no-sleep",
        action="store_true",
        help="refuse /sleep: never lend this server's GPU memory to another service",
    )
    parser.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        help="seconds in-flight requests get to finish after SIGTERM before they are aborted",
    )
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
