"""Writing: one section at a time per request; the run sends them all at once and the backend batches them.
A section that loops (its share of repeated 4-grams above the run's loop_threshold) is rewritten once with
stronger penalties, and the caller is told so that the run's history records it."""

from collections.abc import Callable

from orchestrator.clients.completion_budget import fit
from orchestrator.clients.router import LLMRouter
from orchestrator.pipeline.params import ArticleParams
from orchestrator.pipeline.prose import repeated_share, section_body

ATTEMPTS = 3
TOKENS_PER_WORD = 1.6  # SmolLM2's tokenizer on English prose is ~1.3; the rest is room to end a sentence
MIN_WORDS = 40


def section_messages(outline: dict, index: int, params: ArticleParams, instructions: str | None = None,
                     words: int | None = None) -> list[dict]:
    section = outline["sections"][index]
    plan = "\n".join(f"{i + 1}. {s['heading']}" for i, s in enumerate(outline["sections"]))
    points = "\n".join(f"- {p}" for p in section["key_points"])
    return [
        {"role": "system", "content": f"You are a skilled writer for {params.audience}. You write clear prose"
                                      + (f", in this style: {params.style}." if params.style else ".")},
        {"role": "user", "content": (
            f"The article \"{outline['title']}\" has these sections:\n{plan}\n\n"
            f"Write section {index + 1}, \"{section['heading']}\", covering:\n{points}\n\n"
            f"About {words or params.words_per_section} words of Markdown paragraphs; no heading, no preamble."
            + (f"\n\nFollow these instructions: {instructions}" if instructions else ""))},
    ]


def section_words(params: ArticleParams, sections: int, window: int | None) -> int:
    """Words to ask of each section: the requested length, less when the model's context cannot hold the
    article's sections at that length beside their prompts (a small model then writes shorter, not padded)."""
    if window is None:
        return params.words_per_section
    room = window // 2 // max(1, sections)  # half the context for the article's text, the rest for prompts
    return max(MIN_WORDS, min(params.words_per_section, int(room / TOKENS_PER_WORD)))


async def write_section(llm: LLMRouter, outline: dict, index: int, params: ArticleParams,
                        instructions: str | None = None, words: int | None = None,
                        on_rewrite: Callable[[str], None] | None = None) -> str:
    """A section's text; an empty answer (a small model can end at once) is asked again, up to ATTEMPTS times;
    a looping one is rewritten once with stronger penalties (on_rewrite gets what happened)."""
    messages = section_messages(outline, index, params, instructions, words)
    budget = await fit(llm, messages, int((words or params.words_per_section) * 2.2))
    sampling = params.stage_sampling()
    stage = sampling["sections"]
    for attempt in range(ATTEMPTS):
        seed = None if params.seed is None else params.seed + index + 1000 * attempt
        text = _body(await llm.chat(messages, max_tokens=budget, seed=seed, **stage.chat()))
        if not text:
            continue
        share = repeated_share(text)
        if share <= sampling.loop_threshold:
            return text
        stronger = stage.stronger()
        again = _body(await llm.chat(messages, max_tokens=budget, seed=None if seed is None else seed + 500,
                                     **stronger.chat()))
        after = repeated_share(again) if again else 1.0
        kept = again if again and after < share else text
        if on_rewrite is not None:
            on_rewrite(f"loop guard: {share:.0%} of 4-grams repeated (threshold {sampling.loop_threshold:.0%}); "
                       f"rewritten once with repetition_penalty {stronger.repetition_penalty:g}, frequency_penalty "
                       f"{stronger.frequency_penalty:g}, presence_penalty {stronger.presence_penalty:g}: "
                       f"{after:.0%} repeated; kept the {'rewrite' if kept is again else 'first text'}")
        return kept
    raise ValueError(f"the model wrote nothing for section {index + 1} in {ATTEMPTS} attempts")


def _body(answer: dict) -> str:
    return section_body(answer["text"], cut_short=answer.get("finish_reason") == "length")
