"""llama.cpp's decode speed on a GGUF file, run by bench/engine.py in llama-cpp-python's own venv.

llama-cpp-python is a benchmark peer, never a dependency: install it in a venv of its own and pass that
venv's python to bench/engine.py (--llama-cpp-python PATH, or LLAMA_CPP_PYTHON). Reads
{"model", "prompts", "new_tokens", "threads"} on stdin, prints {"single_tok_s", "batch_tok_s"}; or, for
bench/agents.py, {"mode": "first_token", "model", "conversations", "tools", "n_ctx", "trained", "threads"}, prints
{"first_turn_ttft_s", "next_turn_ttft_s"} (one Llama: the next turn reuses the cached prefix, as llama.cpp does).
"""

import json
import sys
import time


def first_token(job: dict) -> dict:
    from llama_cpp import LLAMA_ROPE_SCALING_TYPE_YARN, Llama

    llm = Llama(model_path=job["model"], n_ctx=job["n_ctx"], n_threads=job["threads"],
                n_threads_batch=job["threads"], rope_scaling_type=LLAMA_ROPE_SCALING_TYPE_YARN,
                rope_freq_scale=job["trained"] / job["n_ctx"], yarn_orig_ctx=job["trained"], verbose=False)
    seconds = []
    for messages in job["conversations"]:
        start = time.perf_counter()
        for chunk in llm.create_chat_completion(messages=messages, tools=job["tools"], max_tokens=16,
                                                temperature=0.0, stream=True):
            delta = chunk["choices"][0]["delta"] if chunk.get("choices") else {}
            if delta.get("content") or delta.get("tool_calls"):
                break
        seconds.append(round(time.perf_counter() - start, 2))
    return {"first_turn_ttft_s": seconds[0], "next_turn_ttft_s": seconds[1]}


def main() -> None:
    from llama_cpp import Llama

    job = json.load(sys.stdin)
    if job.get("mode") == "first_token":
        print(json.dumps(first_token(job)))
        return
    llm = Llama(model_path=job["model"], n_ctx=512, n_threads=job["threads"], n_threads_batch=job["threads"],
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
    # the best of two single runs, as bench/engine.py times every engine
    print(json.dumps({"single_tok_s": max(rates[1:3]), "batch_tok_s": rates[3]}))


if __name__ == "__main__":
    main()
