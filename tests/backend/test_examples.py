"""examples/run_moe.py and examples/run_speculative.py run as a user runs them (subprocesses), on tiny GGUF files;
their outputs are checked against the offline LLM on the same files."""

import json
import os
import subprocess
import sys
from pathlib import Path

from backend import LLM, SamplingParams
from tests.backend.tiny_gguf import POLICY

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
# The tiny llama's own formats with every 32-block type as Q8_0 (its K-quant output layer is random blocks, the
# same in both files): the same model, quantized differently, as a real draft of a larger sibling would be.
CLOSE_DRAFT = {kind: fmt if fmt.endswith("_K") else "Q8_0" for kind, fmt in POLICY["llama"].items()}


def run_example(name: str, *args: str) -> dict:
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / name), *args, "--device", "cpu", "--json"],
        capture_output=True,
        text=True,
        timeout=600,
        env=dict(os.environ),
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_run_moe_answers_as_the_offline_api_does(tiny_gguf):
    path, _ = tiny_gguf("qwen3_moe")
    got = run_example("run_moe.py", "--model", str(path), "--max-tokens", "8", "--max-model-len", "256")
    llm = LLM(str(path), max_model_len=256)
    from examples.run_moe import QUESTIONS

    params = SamplingParams(temperature=0.0, max_tokens=8)
    expected = [
        llm.chat([{"role": "user", "content": q}], params, use_tqdm=False)[0].outputs[0].text
        for q in QUESTIONS
    ]
    assert got["answers"] == expected
    assert got["gpu_experts_per_layer"] == 4 and got["generated_tokens"] > 0


def test_run_speculative_keeps_the_targets_text_and_reports_acceptance(tiny_gguf):
    target, _ = tiny_gguf("llama")
    draft, _ = tiny_gguf("llama", "q8_0", policy=CLOSE_DRAFT)  # the same weights, quantized differently
    got = run_example(
        "run_speculative.py",
        "--target",
        str(target),
        "--draft",
        str(draft),
        "--max-tokens",
        "24",
        "--draft-length",
        "3",
    )
    assert got["identical_to_target"] is True and got["vocab_method"] == "shared"
    assert 0.0 < got["acceptance_rate"] <= 1.0  # a close draft is mostly right
    assert got["speedup"] > 0 and got["target_tok_s"] > 0
    from examples.run_speculative import QUESTION

    llm = LLM(str(target), max_model_len=2048)
    expected = llm.chat(
        [{"role": "user", "content": QUESTION}],
        SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
        use_tqdm=False,
    )
    assert got["text"] == expected[0].outputs[0].text


def test_the_examples_say_what_is_missing(tmp_path):
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / "run_moe.py"), "--model", str(tmp_path / "none.gguf")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1 and "none.gguf not found" in done.stderr and "--model PATH" in done.stderr
