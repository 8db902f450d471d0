"""Research: an outline (title, sections, key points) as validated JSON, grounded in the user's sources."""

import json
from pathlib import Path

from orchestrator.clients.completion_budget import fit
from orchestrator.clients.router import LLMRouter
from orchestrator.pipeline.params import ArticleParams
from orchestrator.pipeline.prose import clean_title

HEADING_WORDS = 8
HEADING_CHARS, TITLE_CHARS, POINT_CHARS = 120, 120, 120

ATTEMPTS = 3
SOURCE_CHARS = 6000  # of each source file, to stay well inside small models' context


class ResearchError(Exception):
    pass


def outline_schema(sections: int) -> dict:
    return {
        "type": "object",
        "properties": {
            # Room for a model's long first try: the grammar closing a string at its limit cuts mid-word, while
            # clean_title shortens at a clause or word boundary (HEADING_WORDS, TITLE_WORDS)
            "title": {"type": "string", "minLength": 3, "maxLength": TITLE_CHARS},
            "sections": {"type": "array", "minItems": sections, "maxItems": sections, "items": {
                "type": "object",
                "properties": {
                    "heading": {"type": "string", "minLength": 2, "maxLength": HEADING_CHARS},
                    "key_points": {"type": "array", "minItems": 2, "maxItems": 3,
                                   "items": {"type": "string", "minLength": 3, "maxLength": POINT_CHARS}},
                },
                "required": ["heading", "key_points"], "additionalProperties": False,
            }},
        },
        "required": ["title", "sections"], "additionalProperties": False,
    }


def read_sources(paths: list[str]) -> list[dict]:
    return [{"name": Path(p).name, "text": Path(p).read_text(errors="replace")[:SOURCE_CHARS]} for p in paths]


def messages_for(params: ArticleParams, sources: list[dict], instructions: str | None = None) -> list[dict]:
    grounding = f"\n\nFollow these instructions: {instructions}" if instructions else ""
    if sources:
        grounding += "\n\nBase the key points on these sources:\n" + "\n\n".join(
            f"--- {s['name']} ---\n{s['text']}" for s in sources)
    return [
        {"role": "system", "content": "You are a careful research assistant. You answer with JSON only."},
        {"role": "user", "content": (
            f"Plan an article about: {params.topic}\nAudience: {params.audience}\n"
            f"Give a title and exactly {params.sections} sections, each with a heading and 2 or 3 key points.\n"
            'Answer with one JSON object: {"title": "...", "sections": [{"heading": "...", "key_points": '
            '["...", "..."]}]}' + grounding)},
    ]


def parse_outline(text: str, sections: int, topic: str) -> dict:
    """The outline in `text`, checked; raises ValueError saying what is wrong. Where nothing of a title is left
    once cleaned, the topic stands in; for a heading (or one repeating an earlier heading), its first key point."""
    start, end = text.find("{"), text.rfind("}")
    if start < 0 or end < start:
        raise ValueError("the answer contains no JSON object")
    try:
        data = json.loads(text[start:end + 1])
    except json.JSONDecodeError as e:
        raise ValueError(f"the JSON does not parse ({e})") from None
    title = data.get("title") if isinstance(data, dict) else None
    if not isinstance(title, str) or not title.strip():
        raise ValueError("the outline has no title")
    items = data.get("sections")
    if not isinstance(items, list) or len(items) != sections:
        raise ValueError(f"the outline needs exactly {sections} sections, got "
                         f"{len(items) if isinstance(items, list) else 'none'}")
    clean, seen = [], set()
    for i, item in enumerate(items):
        heading = item.get("heading") if isinstance(item, dict) else None
        points = item.get("key_points") if isinstance(item, dict) else None
        if not isinstance(heading, str) or not heading.strip():
            raise ValueError(f"section {i + 1} has no heading")
        if not isinstance(points, list) or not points or not all(isinstance(p, str) and p.strip() for p in points):
            raise ValueError(f"section {i + 1} needs a list of key points (strings)")
        stand_in = clean_title(points[0], f"Part {i + 1}", HEADING_WORDS)
        heading = clean_title(heading, stand_in, HEADING_WORDS, min_words=1)
        if heading.lower() in seen:  # a heading the model repeated: its own first key point says what differs
            heading = stand_in
        seen.add(heading.lower())
        clean.append({"heading": heading, "key_points": [p.strip() for p in points]})
    return {"title": clean_title(title, topic), "sections": clean}


async def research(llm: LLMRouter, params: ArticleParams, structured: bool = True,
                   instructions: str | None = None) -> dict:
    """Ask for the outline; a malformed answer is retried (with the problem named) up to ATTEMPTS times."""
    sources = read_sources(params.sources)
    messages = messages_for(params, sources, instructions)
    schema = outline_schema(params.sections) if structured else None
    problem, text = "", ""
    for attempt in range(ATTEMPTS):
        # Room for the schema's longest answer even at one character per token (as small models can write), or
        # what the model's context leaves: a real outline is far shorter than that longest one.
        budget = await fit(llm, messages, 30 + TITLE_CHARS + (50 + HEADING_CHARS + 3 * POINT_CHARS) * params.sections)
        reply = await llm.chat(messages, max_tokens=budget, **params.stage_sampling()["outline"].chat(),
                               json_schema=schema, seed=None if params.seed is None else params.seed + attempt)
        text = reply["text"]
        try:
            outline = parse_outline(text, params.sections, params.topic)
        except ValueError as e:
            problem = str(e)
            messages = messages[:2] + [
                {"role": "assistant", "content": text[:2000]},
                {"role": "user", "content": f"That is not usable: {problem}. Answer again with the JSON object only."},
            ]
            continue
        outline["sources"] = [s["name"] for s in sources]
        outline["attempts"] = attempt + 1
        return outline
    excerpt = text[:200].replace("\n", " ")
    raise ResearchError(f"the model gave no usable outline in {ATTEMPTS} attempts (last problem: {problem}; "
                        f"last answer began: {excerpt!r})")
