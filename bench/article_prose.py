"""Article prose on the embedded default: distinct-3/-4 ratios and words per second of whole articles (outline,
then sections concurrently), before (the old settings: temperature 0.7 only, no loop guard) and after
(pipeline.sampling's defaults), in one run; one JSON line. Needs a backend serving SmolLM2 (`ops up`, or
`python -m backend serve --model smollm2`).

python bench/article_prose.py [--url http://127.0.0.1:8000/v1] [--topics 5] [--seeds 2] [--sections 2] [--words 80]
"""

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from orchestrator.clients.router import LLMRouter  # noqa: E402
from orchestrator.pipeline import research, writing  # noqa: E402
from orchestrator.pipeline.params import ArticleParams  # noqa: E402
from orchestrator.pipeline.prose import distinct_n  # noqa: E402
from orchestrator.pipeline.sampling import PLAIN, Sampling, recorded  # noqa: E402

TOPICS = ["How lighthouses work with solar energy", "The history of porridge", "Why bees dance",
          "How medieval scriptoria copied books", "Caring for a sourdough starter"]
def before_overrides() -> dict:
    plain = recorded(Sampling(dict(PLAIN)))
    plain["loop_threshold"] = 1.0
    return plain  # 1.0: the guard never fires, as before


async def article(llm: LLMRouter, params: ArticleParams) -> dict:
    started = time.perf_counter()
    outline = await research.research(llm, params)
    texts = await asyncio.gather(*(writing.write_section(llm, outline, i, params)
                                   for i in range(len(outline["sections"]))))
    seconds = time.perf_counter() - started
    body = "\n\n".join(texts)
    words = len(body.split())
    return {"topic": params.topic, "seed": params.seed, "title": outline["title"], "words": words,
            "distinct_3": round(distinct_n(body, 3), 3), "distinct_4": round(distinct_n(body, 4), 3),
            "words_per_s": round(words / seconds, 2)}


async def main(args: argparse.Namespace) -> dict:
    rows = {"before": [], "after": []}
    async with LLMRouter([args.url]) as llm:
        for topic in TOPICS[:args.topics]:
            for seed in range(1, args.seeds + 1):
                for label, sampling in (("before", before_overrides()), ("after", {})):
                    params = ArticleParams(topic=topic, sections=args.sections, words_per_section=args.words,
                                           images=0, seed=seed, sampling=sampling)
                    rows[label].append(await article(llm, params))
                    print(json.dumps({label: rows[label][-1]}), file=sys.stderr, flush=True)
    summary = {label: {"min_distinct_4": min(r["distinct_4"] for r in rs),
                       "mean_distinct_4": round(sum(r["distinct_4"] for r in rs) / len(rs), 3),
                       "min_distinct_3": min(r["distinct_3"] for r in rs),
                       "mean_words_per_s": round(sum(r["words_per_s"] for r in rs) / len(rs), 2)}
               for label, rs in rows.items()}
    return {"bench": "article", "url": args.url, "load": os.getloadavg()[0], "sections": args.sections,
            "words_per_section": args.words, "summary": summary, "articles": rows}


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--url", default=os.environ.get("SCRIPTORIUM_LLM_URL", "http://127.0.0.1:8000/v1"))
    parser.add_argument("--topics", type=int, default=5)
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("--sections", type=int, default=2)
    parser.add_argument("--words", type=int, default=80)
    print(json.dumps(asyncio.run(main(parser.parse_args()))))
