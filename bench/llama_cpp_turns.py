"""llama.cpp's time to first token on an agent's turns, run by bench/agents.py in llama-cpp-python's own venv.

Reads {"model", "turns": [[token ids], ...], "threads", "n_ctx", "trained", "restart_before": [turn indices]} on
stdin: llama-cpp-python re-evaluates only the tokens past the prefix it holds from the turn before (generate keeps
the longest common prefix), as llama.cpp's server does with its prompt cache; a turn in restart_before starts
from a newly loaded model, as after a restart of the server (the load itself not timed).
Prints {"seconds": [per turn]}: from the call to the first sampled token. An n_ctx past the trained length gets
YaRN, as our server does.
"""

import json
import sys
import time


def main() -> None:
    from llama_cpp import LLAMA_ROPE_SCALING_TYPE_YARN
    from llama_cpp_open import llama  # bench/, beside this script

    job = json.load(sys.stdin)
    yarn = {}
    if job["n_ctx"] > job["trained"]:
        yarn = {
            "rope_scaling_type": LLAMA_ROPE_SCALING_TYPE_YARN,
            "rope_freq_scale": job["trained"] / job["n_ctx"],
            "yarn_orig_ctx": job["trained"],
        }

    def load():
        return llama(
            model_path=job["model"],
            n_ctx=job["n_ctx"],
            n_threads=job["threads"],
            n_threads_batch=job["threads"],
            verbose=False,
            **yarn,
        )

    llm = load()
    seconds = []
    for i, turn in enumerate(job["turns"]):
        if i in job.get("restart_before", ()):
            del llm
            llm = load()
        start = time.perf_counter()
        next(iter(llm.generate(turn, temp=0.0)))  # reset=True: it keeps the longest common prefix
        seconds.append(time.perf_counter() - start)
    print(json.dumps({"seconds": seconds}))


if __name__ == "__main__":
    main()
