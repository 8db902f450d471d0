"""python -m backend: models pull|list, generate, serve."""

import argparse
import json
import sys

from backend.config_flags import add_engine_arguments, engine_settings
from backend.model_config import ModelLoadError
from backend.model_store import ModelStoreError, format_table, list_models, pull, to_json
from backend.server.serve_flags import add_arguments

# EngineConfig's fields whose flags generate declares itself: its --seed is its one request's (SamplingParams)
GENERATE_OWN = ("model", "seed")


def _generate(args: argparse.Namespace) -> int:
    from backend import LLM, SamplingParams

    llm = LLM(args.model, **engine_settings(args, GENERATE_OWN))
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        seed=args.seed,
        stop=args.stop or None,
    )
    if args.chat:
        outputs = llm.chat([{"role": "user", "content": args.prompt}], params, use_tqdm=False)
    else:
        outputs = llm.generate(args.prompt, params, use_tqdm=False)
    out = outputs[0].outputs[0]
    if args.json:
        print(json.dumps({"text": out.text, "token_ids": out.token_ids, "finish_reason": out.finish_reason}))
    else:
        print(out.text)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m backend", description="Scriptorium's inference backend")
    sub = parser.add_subparsers(dest="command", required=True)

    models = sub.add_parser("models", help="fetch and list known models")
    models_sub = models.add_subparsers(dest="action", required=True)
    p_pull = models_sub.add_parser("pull", help="download a known model into $SCRIPTORIUM_HOME/models")
    p_pull.add_argument("name")
    p_list = models_sub.add_parser("list", help="known models and whether they are present")
    p_list.add_argument("--json", action="store_true")

    gen = sub.add_parser("generate", help="print one completion")
    gen.add_argument("prompt")
    gen.add_argument(
        "--model", default="smollm2", help="an alias (smollm2), a Hugging Face directory or a .gguf"
    )
    add_engine_arguments(gen, GENERATE_OWN)
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stop", action="append", help="a stop string (repeatable)")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    gen.add_argument("--json", action="store_true")

    srv = sub.add_parser("serve", help="run the OpenAI-compatible HTTP server")
    add_arguments(srv)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "models" and args.action == "pull":
            from pathlib import Path

            from backend.model_store import KNOWN_MODELS

            # A model given as a path needs no fetching: ops' prepare step pulls whatever --model names.
            path = (
                Path(args.name).expanduser()
                if args.name not in KNOWN_MODELS and Path(args.name).expanduser().exists()
                else pull(args.name)
            )
            print(path)
            return 0
        if args.command == "models" and args.action == "list":
            rows = list_models()
            print(to_json(rows) if args.json else format_table(rows))
            return 0
        if args.command == "generate":
            return _generate(args)
        if args.command == "serve":
            from backend.server.serve import serve

            return serve(args)
    except (ModelStoreError, ModelLoadError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 2


if __name__ == "__main__":
    sys.exit(main())
