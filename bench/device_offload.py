"""bench/device.py's offload figure: decode with MoE experts that do not fit the card, copied in as routed to (and
ahead, on a guess of the next layer's routing) or computed by the CPU where they are."""

import random
import time

from backend import LLM, SamplingParams


def offload_figure(llm: LLM, name: str, smoke: bool) -> dict:
    """Decode with offloaded experts: tokens/s, and the expert bytes copied to the card per decode token (with
    moe_cpu_compute: none; the (token, expert) pairs the host computed instead). Copying, also without the copies
    ahead on a guess of the next layer's routing, and how many of those the next layer used."""
    caches = [m.expert_cache for m in llm.engine.model.modules() if getattr(m, "expert_cache", None) is not None]
    cpu_compute = llm.engine.config.moe_cpu_compute
    one_expert = [0 if cpu_compute else sum(h[0].numel() * h.element_size() for h in c.host) for c in caches]

    def counts() -> tuple[int, int, int]:  # bytes copied (or host pairs), copies ahead, of those used
        if cpu_compute:
            return sum(c.host_pairs for c in caches), 0, 0
        return (sum((c.misses + c.prefetched) * b for c, b in zip(caches, one_expert)),
                sum(c.prefetched for c in caches), sum(c.prefetch_hits for c in caches))

    new_tokens = 8 if smoke else 64
    prompt = [[random.randrange(500) for _ in range(32)]]
    llm.generate(prompt, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)

    def decode() -> tuple[float, list[int]]:
        runs = {}
        for tokens in (1, new_tokens + 1):  # the prompt and a first token, then the same with the decode after it
            before, start = counts(), time.perf_counter()
            llm.generate(prompt, SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True), use_tqdm=False)
            runs[tokens] = (time.perf_counter() - start, [b - a for a, b in zip(before, counts())])
        # the long run's own counts over its tokens: the short run's prefill met another state of the slots (its
        # difference from the long run came out negative on the H200)
        return new_tokens / max(runs[new_tokens + 1][0] - runs[1][0], 1e-9), runs[new_tokens + 1][1]

    tok_s, (moved, ahead, used) = decode()
    figure = {"figure": "decode_batch1_offloaded" + ("_cpu_compute" if cpu_compute else ""), "model": name,
              "weights": "Q4_K", "gpu_experts_per_layer": caches[0].slots if caches else None,
              "host_expert_gib": round(sum(c.host_bytes() for c in caches) / 2**30, 2), "tok_s": round(tok_s, 1),
              "host_pairs_per_token" if cpu_compute else "pcie_bytes_per_token": round(moved / (new_tokens + 1), 2)}
    if not cpu_compute:
        links = [c.next for c in caches]
        for c in caches:
            c.next = None
        without, (moved_without, _, _) = decode()
        for c, link in zip(caches, links):
            c.next = link
        figure.update(copies_ahead_per_token=round(ahead / (new_tokens + 1), 2),
                      copies_ahead_used_per_token=round(used / (new_tokens + 1), 2),
                      tok_s_without_copies_ahead=round(without, 1),
                      pcie_bytes_per_token_without_copies_ahead=round(moved_without / (new_tokens + 1), 2))
    return figure
