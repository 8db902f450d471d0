"""Writing: one section at a time per request; the run sends them all at once and the backend batches them."""

from orchestrator.clients.context import fit
from orchestrator.clients.router import LLMRouter
from orchestrator.pipeline.params import ArticleParams

ATTEMPTS = 3


def section_messages(outline: dict, index: int, params: ArticleParams, instructions: str | None = None) -> list[dict]:
    section = outline["sections"][index]
    plan = "\n".join(f"{i + 1}. {s['heading']}" for i, s in enumerate(outline["sections"]))
    points = "\n".join(f"- {p}" for p in section["key_points"])
    return [
        {"role": "system", "content": f"You are a skilled writer for {params.audience}. You write clear prose"
                                      + (f", in this style: {params.style}." if params.style else ".")},
        {"role": "user", "content": (
            f"The article \"{outline['title']}\" has these sections:\n{plan}\n\n"
            f"Write section {index + 1}, \"{section['heading']}\", covering:\n{points}\n\n"
            f"About {params.words_per_section} words of Markdown paragraphs; no heading, no preamble."
            + (f"\n\nFollow these instructions: {instructions}" if instructions else ""))},
    ]


async def write_section(llm: LLMRouter, outline: dict, index: int, params: ArticleParams,
                        instructions: str | None = None) -> str:
    """A section's text; an empty answer (a small model can end at once) is asked again, up to ATTEMPTS times."""
    messages = section_messages(outline, index, params, instructions)
    budget = await fit(llm, messages, int(params.words_per_section * 2.2))
    for attempt in range(ATTEMPTS):
        seed = None if params.seed is None else params.seed + index + 1000 * attempt
        reply = await llm.chat(messages, max_tokens=budget,
                               temperature=params.temperature, seed=seed)
        text = reply["text"].strip()
        if text:
            return text
    raise ValueError(f"the model wrote nothing for section {index + 1} in {ATTEMPTS} attempts")
