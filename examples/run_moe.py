"""A Mixture-of-Experts GGUF (Mixtral-8x7B-Instruct Q4_K_M by default) through the step-wise engine API.

The weights stay quantized from the file to the matmul (about 26 GB for Mixtral at Q4_K_M); experts that
do not fit the GPU budget stay in host memory, still quantized (enable_cpu_offload=True).

    python examples/run_moe.py
    python examples/run_moe.py --model path/to/model.gguf --max-tokens 64 --json
"""

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from backend import EngineArgs, LLMEngine, SamplingParams  # noqa: E402
from backend.home import models_dir  # noqa: E402

DEFAULT_MODEL = models_dir() / "mixtral-8x7b-instruct-v0.1.Q4_K_M.gguf"
QUESTIONS = ["What is a Mixture-of-Experts language model?", "Why do scribes rule lines before writing?"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model", default=str(DEFAULT_MODEL), help="a MoE .gguf file (Mixtral, Qwen2-MoE, Qwen3-MoE)"
    )
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    parser.add_argument("--json", action="store_true", help="one JSON document on stdout")
    args = parser.parse_args()
    if not Path(args.model).exists():
        sys.exit(
            f"{args.model} not found; download a MoE GGUF (e.g. {DEFAULT_MODEL.name}) or pass --model PATH"
        )

    engine = LLMEngine.from_engine_args(
        EngineArgs(
            model=args.model,
            max_model_len=args.max_model_len,
            gpu_memory_utilization=args.gpu_memory_utilization,
            quantization="gguf",
            enable_cpu_offload=True,
            device=args.device,
        )
    )
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    for i, question in enumerate(QUESTIONS):
        engine.add_request(str(i), [{"role": "user", "content": question}], params)

    answers, tokens, start = {}, 0, time.perf_counter()
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                answers[output.request_id] = output.outputs[0].text
                tokens += len(output.outputs[0].token_ids)
    seconds = time.perf_counter() - start

    experts = engine.moe_gpu_experts or engine.model_config.num_experts
    if args.json:
        print(
            json.dumps(
                {
                    "answers": [answers[str(i)] for i in range(len(QUESTIONS))],
                    "generated_tokens": tokens,
                    "seconds": round(seconds, 3),
                    "gpu_experts_per_layer": experts,
                }
            )
        )
        return 0
    for i, question in enumerate(QUESTIONS):
        print(f"Q: {question}\nA: {answers[str(i)].strip()}\n")
    print(
        f"{tokens} tokens in {seconds:.1f} s ({tokens / seconds:.1f} tok/s); "
        f"{experts} of {engine.model_config.num_experts} experts per layer on the device"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
