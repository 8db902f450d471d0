"""llama.cpp's side of bench/iq_formats.py, run in llama-cpp-python's own venv (a benchmark peer, never a dependency).

Reads one JSON job on stdin and prints one JSON object:
  {"action": "quantize", "source", "out", "ftype", "threads"}: llama_model_quantize (requantizing allowed) -> {}
  {"action": "rates", "model", "prompt", "new_tokens", "threads"}: prompt tokens/s (the prompt evaluated in one
  call, best of three) and batch-1 decode tokens/s (one token a step after it) -> {"prompt_tok_s", "decode_tok_s"}
"""

import ctypes
import json
import sys
import time


def quantize(job: dict) -> dict:
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = job["ftype"]
    params.allow_requantize = True
    params.nthread = job["threads"]
    failed = llama_cpp.llama_model_quantize(job["source"].encode(), job["out"].encode(), ctypes.byref(params))
    if failed:
        raise SystemExit(f"llama_model_quantize failed ({failed}) on {job['source']}")
    return {}


def rates(job: dict) -> dict:
    from llama_cpp_open import llama  # bench/, beside this script

    prompt, new_tokens = job["prompt"], job["new_tokens"]
    llm = llama(
        model_path=job["model"],
        n_ctx=len(prompt) + new_tokens + 8,
        n_batch=len(prompt),
        n_threads=job["threads"],
        n_threads_batch=job["threads"],
        verbose=False,
    )
    prompt_s, decode_s = [], []
    for _ in range(3):
        llm.reset()
        start = time.perf_counter()
        llm.eval(prompt)
        prompt_s.append(time.perf_counter() - start)
        start = time.perf_counter()
        for i in range(new_tokens):
            llm.eval([prompt[i % len(prompt)]])
        decode_s.append(time.perf_counter() - start)
    return {"prompt_tok_s": len(prompt) / min(prompt_s), "decode_tok_s": new_tokens / min(decode_s)}


if __name__ == "__main__":
    job = json.load(sys.stdin)
    print(json.dumps({"quantize": quantize, "rates": rates}[job["action"]](job)))
