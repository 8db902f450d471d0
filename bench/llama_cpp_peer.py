"""llama.cpp's decode speed on a GGUF file, run by bench/engine_vs_peers.py in llama-cpp-python's own venv.

llama-cpp-python is a benchmark peer, never a dependency: install it in a venv of its own and pass that
venv's python to bench/engine_vs_peers.py (--llama-cpp-python PATH, or LLAMA_CPP_PYTHON). Reads
{"model", "prompts", "new_tokens", "threads"} on stdin, prints {"single_tok_s", "batch_tok_s"}.
"""

import json
import sys
import time


def main() -> None:
    from llama_cpp_open import llama  # bench/, beside this script

    job = json.load(sys.stdin)
    llm = llama(model_path=job["model"], n_ctx=512, n_threads=job["threads"], n_threads_batch=job["threads"],
                verbose=False)
    prompts, new_tokens = job["prompts"], job["new_tokens"]
    rates = []
    for batch in (prompts[:1], prompts[:1], prompts[:1], prompts[1:]):  # the first single run warms up
        start = time.perf_counter()
        for p in batch:  # llama-cpp-python serves one sequence at a time
            llm.reset()
            for i, _ in enumerate(llm.generate(p, temp=0.0)):
                if i + 1 == new_tokens:
                    break
        rates.append(new_tokens * len(batch) / (time.perf_counter() - start))
    # the best of two single runs, as bench/engine_vs_peers.py times every engine
    print(json.dumps({"single_tok_s": max(rates[1:3]), "batch_tok_s": rates[3]}))


if __name__ == "__main__":
    main()
