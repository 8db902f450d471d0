"""llama.cpp's decode speed after a long prompt, run by bench/long_decode.py in llama-cpp-python's own venv.

Reads {"model", "prompt": [token ids], "new_tokens", "threads", "n_ctx", "flash_attn"} on stdin: evaluates the
prompt, then times new_tokens greedy decode steps (sample, then evaluate the token), the prompt's evaluation left
out. Prints {"decode_tok_s"}.
"""

import json
import sys
import time


def main() -> None:
    from llama_cpp_open import llama  # bench/, beside this script

    job = json.load(sys.stdin)
    llm = llama(model_path=job["model"], n_ctx=job["n_ctx"], n_threads=job["threads"], n_threads_batch=job["threads"],
                flash_attn=job["flash_attn"], verbose=False)
    llm.eval(job["prompt"])
    start = time.perf_counter()
    for _ in range(job["new_tokens"]):
        llm.eval([llm.sample(temp=0.0)])
    print(json.dumps({"decode_tok_s": job["new_tokens"] / (time.perf_counter() - start)}))


if __name__ == "__main__":
    main()
