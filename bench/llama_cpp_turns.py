"""llama.cpp's time to first token on an agent's turns, run by bench/agents.py in llama-cpp-python's own venv.

Reads {"model", "turns": [[token ids], ...], "threads", "n_ctx", "trained"} on stdin: each turn's prompt
extends the one before (an agent's conversation), and llama-cpp-python re-evaluates only the tokens past the
prefix it holds (generate keeps the longest common prefix), as llama.cpp's server does with its prompt cache.
Prints {"seconds": [per turn]}: from the call to the first sampled token. An n_ctx past the trained length gets
YaRN, as our server does.
"""

import json
import sys
import time


def main() -> None:
    from llama_cpp import LLAMA_ROPE_SCALING_TYPE_YARN, Llama

    job = json.load(sys.stdin)
    yarn = {}
    if job["n_ctx"] > job["trained"]:
        yarn = {"rope_scaling_type": LLAMA_ROPE_SCALING_TYPE_YARN, "rope_freq_scale": job["trained"] / job["n_ctx"],
                "yarn_orig_ctx": job["trained"]}
    llm = Llama(model_path=job["model"], n_ctx=job["n_ctx"], n_threads=job["threads"],
                n_threads_batch=job["threads"], verbose=False, **yarn)
    seconds = []
    for turn in job["turns"]:
        start = time.perf_counter()
        next(iter(llm.generate(turn, temp=0.0)))  # reset=True: it keeps the longest common prefix
        seconds.append(time.perf_counter() - start)
    print(json.dumps({"seconds": seconds}))


if __name__ == "__main__":
    main()
