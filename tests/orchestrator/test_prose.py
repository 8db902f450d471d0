import json

import pytest

from orchestrator.pipeline.params import ArticleParams, ParamsError
from orchestrator.pipeline.prose import clean_title, demote_headings, distinct_n, repeated_share, section_body
from orchestrator.pipeline.research import HEADING_CHARS, HEADING_WORDS, outline_schema, parse_outline
from orchestrator.pipeline.sampling import DEFAULTS, resolve


def test_distinct_n_counts_repeated_word_sequences():
    assert distinct_n("one two three four five", 4) == 1.0
    looped = "the secrets of the scriptorium " * 4
    # 20 words, 17 4-grams, of which only 5 are distinct
    assert distinct_n(looped, 4) == pytest.approx(5 / 17)
    assert repeated_share(looped) == pytest.approx(12 / 17)
    assert distinct_n("", 4) == 1.0


@pytest.mark.parametrize("raw, title", [
    ("Here is a summary of how lighthouses work with solar energy, which is a crucial",
     "How lighthouses work with solar energy"),
    ('Sure! Here is the title: "Bees: Why They Dance"', "Bees: Why They Dance"),
    ("## **The Porridge Book**", "The Porridge Book"),
    ("Lighthouses at night. They guide ships.", "Lighthouses at night"),
    ("one two three four five six seven eight nine ten eleven twelve of the", "One two three four five six seven "
     "eight nine ten"),
    ("Here is", "Solar lighthouses"),
    ("1. How lenses focus light", "How lenses focus light"),
    ("Section 2: The keeper's night", "The keeper's night"),
    ("10 Things to Know About Lighthouses", "10 Things to Know About Lighthouses"),
])
def test_titles_are_short_complete_and_without_preamble(raw, title):
    assert clean_title(raw, "solar lighthouses") == title


def test_sampling_overrides_lay_over_the_defaults_and_are_recorded():
    params = ArticleParams(topic="t", sampling={"sections": {"repetition_penalty": 1.3}, "loop_threshold": 0.2})
    assert params.sampling["sections"]["repetition_penalty"] == 1.3
    assert params.sampling["sections"]["temperature"] == DEFAULTS["sections"].temperature
    assert params.sampling["loop_threshold"] == 0.2
    assert params.stage_sampling()["image_prompts"] == DEFAULTS["image_prompts"]
    # what params.json stores reads back as the same run
    assert ArticleParams.from_dict(params.to_dict()).sampling == params.sampling
    assert resolve(None, 0.2)["outline"].temperature == 0.2


@pytest.mark.parametrize("bad", [{"writing": {}}, {"sections": {"top_k": 3}}, {"sections": {"temperature": 5}},
                                 {"loop_threshold": 0}, {"outline": {"stop": [""]}}])
def test_bad_sampling_is_refused_with_its_name(bad):
    with pytest.raises(ParamsError, match="sampling"):
        ArticleParams(topic="t", sampling=bad)


@pytest.mark.parametrize("raw, cut_short, body", [
    ("## Cutting a nib\n\nA sharp knife matters.", False, "A sharp knife matters."),
    ("Sure! Here is section 2:\n\n**Cutting a nib**\nA sharp knife matters.", False, "A sharp knife matters."),
    ("Here's the section on nibs:\nA sharp knife matters.", False, "A sharp knife matters."),
    ("A sharp knife matters, and a steady hand matters more. Hold the quill and", True,
     "A sharp knife matters, and a steady hand matters more."),
    ("A sharp knife matters. Hold the quill at an angle and", False,
     "A sharp knife matters. Hold the quill at an angle and"),
    # the last full sentence is too early to end at: the text stays as written
    ("Short. " + "a long run of words without any end " * 5, True,
     "Short. " + ("a long run of words without any end " * 5).strip()),
    ("### Only a heading", False, ""),
    ("Here is why nibs matter: a sharp knife.", False, "Here is why nibs matter: a sharp knife."),
])
def test_section_bodies_lose_restated_headings_and_openers_and_end_at_a_sentence(raw, cut_short, body):
    assert section_body(raw, cut_short) == body


def test_headings_inside_a_section_go_under_the_sections_heading():
    text = "Intro.\n\n# Big\n\ntext\n\n## Smaller\n\n```\n# a comment in code\n```\n"
    assert demote_headings(text, 3) == "Intro.\n\n### Big\n\ntext\n\n#### Smaller\n\n```\n# a comment in code\n```"
    assert demote_headings("#### Deep\n", 3) == "#### Deep\n"  # already below: left as written
    assert demote_headings("no headings", 3) == "no headings"


def test_a_long_heading_is_shortened_at_a_boundary_not_cut_by_the_grammar():
    """The schema leaves a model room for a long first heading (a grammar closing the string at its limit would
    cut mid-word); parse_outline shortens it to a phrase of at most HEADING_WORDS words."""
    long = "The early history of solar lighthouses, which changed how coastal regions of Europe saw the night"
    schema = outline_schema(2)["properties"]["sections"]["items"]["properties"]["heading"]
    assert len(long) <= schema["maxLength"] == HEADING_CHARS  # the model may write it whole
    text = json.dumps({"title": "Lighthouses", "sections": [
        {"heading": long, "key_points": ["a", "b"]}, {"heading": "Lenses", "key_points": ["c", "d"]}]})
    heading = parse_outline(text, 2, "lighthouses")["sections"][0]["heading"]
    assert heading == "The early history of solar lighthouses"
    assert len(heading.split()) <= HEADING_WORDS


def test_an_outline_keeps_one_word_and_numbered_headings_and_stands_in_the_topic_for_a_lost_title():
    """What SmolLM2 wrote for the demo's outline: numbered headings ("1. Date of Publication" became "Part 1"), a
    one-word heading, a title of one word (the article was called "Untitled"), a heading of nothing but a number,
    "Section 4", and a repeated heading. Where a heading says nothing (or what an earlier one said), its first key
    point stands in."""
    text = json.dumps({"title": "Scriptoria", "sections": [
        {"heading": "1. Date of Publication", "key_points": ["when the books were made", "by whom"]},
        {"heading": "Parchment", "key_points": ["calf skin", "scraped thin"]},
        {"heading": "3.", "key_points": ["Copying by candlelight, which was slow", "errors"]},
        {"heading": "Section 4", "key_points": ["Ink from oak galls", "quills"]},
        {"heading": "parchment", "key_points": ["Binding the quires", "boards"]}]})
    outline = parse_outline(text, 5, "How medieval scriptoria copied books")
    assert outline["title"] == "How medieval scriptoria copied books"
    assert [s["heading"] for s in outline["sections"]] == ["Date of Publication", "Parchment", "Copying by candlelight",
                                                           "Ink from oak galls", "Binding the quires"]
