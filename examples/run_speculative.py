"""Speculative decoding with a target GGUF and a smaller draft GGUF (the walkthrough's pair by default:
Llama-3.1-8B-Instruct, a 128,256-token vocabulary, with TinyLlama-1.1B-Chat, Llama 2's 32,000), through the
step-wise engine API: the same greedy text as the target alone, how the draft's vocabulary meets the target's
(shared, or token-level intersection), its acceptance rate, and the speed-up over the target alone.

    python examples/run_speculative.py
    python examples/run_speculative.py --target big.gguf --draft small.gguf --draft-length 5 --json
"""

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from backend import EngineArgs, LLMEngine, SamplingParams  # noqa: E402
from backend.home import models_dir  # noqa: E402

DEFAULT_TARGET = models_dir() / "Meta-Llama-3.1-8B-Instruct-Q4_K_M.gguf"
DEFAULT_DRAFT = models_dir() / "tinyllama-1.1b-chat-v1.0.Q4_K_M.gguf"
QUESTION = "Write a short paragraph about how a medieval scriptorium copied books."


def generate(args: argparse.Namespace, draft: str | None) -> tuple[list[int], str, float, dict, str]:
    """(token ids, text, seconds of decoding, engine stats, the draft's vocabulary method) for one greedy
    request."""
    engine = LLMEngine.from_engine_args(
        EngineArgs(
            model=args.target,
            max_model_len=args.max_model_len,
            quantization="gguf",
            device=args.device,
            speculative_model=draft,
            speculative_draft_length=args.draft_length,
        )
    )
    messages = [{"role": "user", "content": QUESTION}]
    engine.add_request("warm-up", messages, {"max_tokens": 2})  # kernels compiled, graphs captured
    while engine.has_unfinished_requests():
        engine.step()
    engine.add_request(
        "0", messages, SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    )
    start, final = time.perf_counter(), None
    while engine.has_unfinished_requests():
        for output in engine.step():
            final = output if output.finished else final
    seconds = time.perf_counter() - start
    method = "none" if draft is None else "intersection" if engine.vocab_bridge is not None else "shared"
    return final.outputs[0].token_ids, final.outputs[0].text, seconds, engine.stats(), method


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--target", default=str(DEFAULT_TARGET), help="the model whose output you want (.gguf)"
    )
    parser.add_argument(
        "--draft", default=str(DEFAULT_DRAFT), help="a small model (any vocabulary: shared or intersected)"
    )
    parser.add_argument("--draft-length", type=int, default=5, help="tokens the draft proposes per step")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    parser.add_argument("--json", action="store_true", help="one JSON document on stdout")
    args = parser.parse_args()
    for path in (args.target, args.draft):
        if not Path(path).exists():
            sys.exit(f"{path} not found; download the GGUF files or pass --target PATH --draft PATH")

    plain_ids, plain_text, plain_s, _, _ = generate(args, None)
    spec_ids, spec_text, spec_s, stats, method = generate(args, args.draft)
    acceptance = stats["spec_accepted_tokens"] / max(stats["spec_draft_tokens"], 1)
    result = {
        "identical_to_target": spec_ids == plain_ids,
        "vocab_method": method,
        "acceptance_rate": round(acceptance, 3),
        "speedup": round(plain_s / spec_s, 3),
        "target_tok_s": round(len(plain_ids) / plain_s, 1),
        "speculative_tok_s": round(len(spec_ids) / spec_s, 1),
        "text": spec_text,
    }
    if args.json:
        print(json.dumps(result))
        return 0
    print(spec_text.strip(), "\n")
    print(
        f"draft vocabulary: {method}; acceptance rate {acceptance:.0%}; {result['speculative_tok_s']} tok/s with the draft vs "
        f"{result['target_tok_s']} alone: {result['speedup']:.2f}x; identical to the target: "
        f"{result['identical_to_target']}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
