"""Speculative decoding vs plain decoding, SmolLM2-135M on the CPU, greedy, in one run.

One JSON line per workload: n-gram lookup on extractive work (copying a passage, editing
code) at batch 1; free-form generation at batch 1 and with 32 concurrent requests; and the
target as its own draft (the mechanism's upper bound), and the same with the draft's vocabulary shuffled
(bench/shuffled_gguf.py: the same predictions through other ids, drafting by token-level intersection, so the
difference is what drafting across vocabularies costs). Then extractive and free-form again with
8-bit activations (activations="int8": integer products, a verification row a third of fp32's
cost with AVX-512 VNNI) and, where the CPU has AMX, in a bfloat16 engine, whose verification rows
are nearly free there (the codes on the tiles; elsewhere a bfloat16 engine is the float32 one).
Run: python bench/speculative.py
"""

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from backend import LLM, SamplingParams  # noqa: E402
from backend.kernels import native  # noqa: E402
from backend.model_store import pull  # noqa: E402
from bench.shuffled_gguf import shuffle_vocab  # noqa: E402
from tests.backend.price_function import PRICE_FUNCTION  # noqa: E402

PASSAGE = (
    "In the scriptorium the monks worked in silence from the first light until the bell for vespers. "
    "Each scribe had a sloping desk, a horn of black ink, a knife for sharpening quills and a pumice "
    "stone for smoothing the parchment. The master read every page against the exemplar, and a page "
    "with a single error was scraped clean and written again."
)
EXTRACTIVE = [
    [{"role": "user", "content": f"Repeat the following text exactly, word for word:\n\n{PASSAGE}"}],
    [{"role": "user", "content": f"Rename the variable subtotal to net in this code and return the whole "
                                 f"code:\n\n{PRICE_FUNCTION}"}],
]
FREE = [[{"role": "user", "content": f"Write a short story about a scribe named {name}."}]
        for name in ("Aelfric", "Brigid", "Cuthbert", "Dunstan", "Eadgyth", "Finnian", "Gisela", "Hild")]


def run(llm: LLM, conversations, max_tokens: int) -> tuple[float, list[list[int]]]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    start = time.perf_counter()
    outs = llm.chat(conversations, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    tokens = [o.outputs[0].token_ids for o in outs]
    return sum(len(t) for t in tokens) / elapsed, tokens


def compare(name: str, plain: LLM, spec: LLM, conversations, max_tokens: int, batch: int, repeats: int = 3) -> None:
    """Plain and speculative runs alternate `repeats` times; the medians are reported (this VM is noisy)."""
    before = dict(spec.engine.stats())
    groups = [conversations[i:i + batch] for i in range(0, len(conversations), batch)]
    base_runs, spec_runs = [], []
    identical = True
    for _ in range(repeats):
        for runs, llm in ((base_runs, plain), (spec_runs, spec)):
            tps, tokens = zip(*(run(llm, group, max_tokens) for group in groups))
            runs.append((tps, [t for group in tokens for t in group]))
        identical &= base_runs[-1][1] == spec_runs[-1][1]
    base_tps = statistics.median(statistics.mean(r[0]) for r in base_runs)
    spec_tps = statistics.median(statistics.mean(r[0]) for r in spec_runs)
    # each group's own speedup and output length: which prompts the model really answers by copying
    per_group = [round(statistics.median(r[0][g] for r in spec_runs) / statistics.median(r[0][g] for r in base_runs),
                       3) for g in range(len(groups))]
    lengths = [len(t) for t in spec_runs[-1][1]]
    after = spec.engine.stats()
    drafted = after["spec_draft_tokens"] - before["spec_draft_tokens"]
    accepted = after["spec_accepted_tokens"] - before["spec_accepted_tokens"]
    print(json.dumps({
        "bench": "speculative", "workload": name, "products": spec.engine.products,
        "batch": batch, "method": spec.engine.stats()["spec_method"],
        "num_tokens": spec.engine.spec.num_tokens, "plain_tok_s": round(base_tps, 2),
        "speculative_tok_s": round(spec_tps, 2), "speedup": round(spec_tps / base_tps, 3),
        "identical": identical, "per_prompt_speedup": per_group if batch == 1 else None,
        "output_tokens": lengths if batch == 1 else None, "drafted": drafted,
        "acceptance_rate": round(accepted / drafted, 3) if drafted else None,
    }), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--drafts-only", action="store_true",
                        help="only the draft-model rows: the same vocabulary against a shuffled one")
    args = parser.parse_args()
    pull("smollm2", quiet=True)
    plain = LLM("smollm2", max_num_seqs=64)
    run(plain, FREE[:1], 8)  # warm-up
    if not args.drafts_only:
        ngram = LLM("smollm2", max_num_seqs=64, speculative={"method": "ngram", "num_tokens": "auto"})
        run(ngram, FREE[:1], 8)
        compare("extractive", plain, ngram, EXTRACTIVE, args.max_tokens, batch=1)
        compare("free-form", plain, ngram, FREE[:2], args.max_tokens, batch=1)
        compare("free-form", plain, ngram, (FREE * 4)[:32], args.max_tokens, batch=32)
        del ngram
    shuffled = shuffle_vocab(pull("smollm2", quiet=True), Path(tempfile.mkdtemp()) / "smollm2-shuffled.gguf")
    drafts = {"self-draft": {"model": "smollm2"},
              "self-draft, shuffled vocabulary, intersection": {"model": str(shuffled), "vocab": "intersection"},
              "self-draft, shuffled vocabulary, string": {"model": str(shuffled), "vocab": "string"}}
    for name, settings in drafts.items():
        spec = LLM("smollm2", max_num_seqs=64, speculative={"method": "draft", "num_tokens": 4, **settings})
        for workload, conversations in (("extractive", EXTRACTIVE), ("free-form", FREE[:1])):
            compare(f"{name}, {workload}", plain, spec, conversations, args.max_tokens, batch=1)
        del spec
    del plain
    if args.drafts_only:
        return
    for products, settings in (("int8", {"activations": "int8"}), ("bfloat16", {"dtype": "bfloat16"})):
        if products == "bfloat16" and not native.amx():  # without AMX a bfloat16 engine is the float32 one
            continue
        plain = LLM("smollm2", max_num_seqs=64, **settings)
        ngram = LLM("smollm2", max_num_seqs=64, speculative={"method": "ngram", "num_tokens": "auto"}, **settings)
        run(plain, FREE[:1], 8)
        run(ngram, FREE[:1], 8)
        compare("extractive", plain, ngram, EXTRACTIVE, args.max_tokens, batch=1)
        compare("free-form", plain, ngram, FREE[:2], args.max_tokens, batch=1)
        del plain, ngram

if __name__ == "__main__":
    main()
