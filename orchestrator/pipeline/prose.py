"""Measures of how text reads (distinct-n, the share of repeated n-grams); titles cut to be titles; section
bodies without the heading or preamble a model puts first, ending at a sentence, their headings under the
section's own."""

import re

WORD = re.compile(r"[\w'’-]+")
PREAMBLE = re.compile(
    r"^(?:sure[,!.]?\s*)?(?:here\s+(?:is|are)|this\s+is|below\s+is|title\s*:|the\s+title\s+is)"
    r"(?:\s+(?:a|an|the|my|your))?(?:\s+(?:short|brief|possible|suggested))?"
    r"(?:\s+(?:summary|outline|article|overview|title|plan|draft|section))?(?:\s+(?:of|on|about|for))?\s*[:,-]?\s*",
    re.IGNORECASE,
)
TITLE_WORDS = 10
_PART, _NUMBER = r"(?:section|part|chapter)\s+", r"(?:\d{1,2}|[ivx]{1,4})"
# a list's numbering or a "Section 2:" a model puts before a heading ("1. Dating the manuscripts")
NUMBERING = re.compile(rf"^(?:{_PART})?{_NUMBER}(?:[.):]|\s+-|\s+—)\s+(?=\S)", re.IGNORECASE)
GENERIC = re.compile(rf"{_PART}{_NUMBER}[.:]?", re.IGNORECASE)  # "Section 2" alone: no subject named


def words(text: str) -> list[str]:
    return [w.lower() for w in WORD.findall(text)]


def distinct_n(text: str, n: int) -> float:
    """Distinct n-grams over all n-grams of the text's words (1.0 when it has none): human prose is above 0.97
    for n=4; a model that loops falls far below."""
    grams = ngrams(words(text), n)
    return len(set(grams)) / len(grams) if grams else 1.0


def repeated_share(text: str, n: int = 4) -> float:
    """The share of n-grams that repeat an earlier one (1 - distinct-n)."""
    return 1.0 - distinct_n(text, n)


def ngrams(tokens: list[str], n: int) -> list[tuple[str, ...]]:
    return [tuple(tokens[i:i + n]) for i in range(len(tokens) - n + 1)]


def clean_title(text: str, fallback: str, max_words: int = TITLE_WORDS, min_words: int = 2) -> str:
    """A title from what the model wrote: no preamble ("Here is a summary of"), numbering ("1.", "Section 2:"),
    Markdown or quotes, its first sentence or clause; cut at a word boundary only when even that is longer than
    max_words. `fallback` (the topic) stands in when fewer than min_words words (with a letter) are left."""
    title = " ".join(text.replace("#", " ").replace("*", " ").split()).strip(" \"'“”‘’`")
    for _ in range(2):  # "Sure! Here is the title: ..." has two layers
        title = PREAMBLE.sub("", title, count=1).strip(" \"'“”‘’`:-")
    title = NUMBERING.sub("", title, count=1)
    if GENERIC.fullmatch(title):
        title = ""
    sentence = re.split(r"(?<=[.!?])\s", title, maxsplit=1)[0].rstrip(".")
    # a relative clause ("..., which is a crucial") is where a model's long title runs on and gets cut
    head, _, tail = sentence.partition(", ")
    if tail and len(head.split()) >= 2 and tail.split()[0].lower() in {"which", "that", "where", "who", "and"}:
        sentence = head
    if len(sentence.split()) > max_words:
        # a clause boundary (a colon, a dash, a comma) reads better than any word boundary
        for mark in (":", " - ", " — ", ","):
            head = sentence.split(mark, 1)[0].strip()
            if 2 <= len(head.split()) <= max_words:
                sentence = head
                break
    if len(sentence.split()) > max_words:
        sentence = _cut(sentence, max_words)
    sentence = sentence.strip(" ,;:-\"'")
    if sum(any(c.isalpha() for c in w) for w in words(sentence)) < min_words:  # a bare number is no title
        sentence = _cut(" ".join(fallback.split()), max_words)
    return sentence[:1].upper() + sentence[1:]


SMALL = {"a", "an", "the", "and", "or", "of", "to", "in", "on", "for", "with", "which", "that", "is", "are",
         "as", "by", "at", "from", "its", "their", "how", "why", "but"}


def _cut(text: str, max_words: int) -> str:
    """The first max_words words, less the trailing small words that leave a phrase open ("... which is a")."""
    kept = text.split()[:max_words]
    while len(kept) > 2 and kept[-1].lower().strip(",;:") in SMALL:
        kept.pop()
    return " ".join(kept).rstrip(",;:")


OPENER = re.compile(r"^(?:sure|certainly|of course|okay|ok|absolutely|great)\b[^\n]{0,80}[:!]\s*$|^here(?:'s|\s+is|\s+are)\b"
                    r"[^\n]{0,120}:\s*$", re.IGNORECASE)
SENTENCE_END = re.compile(r"[.!?][\"'”’)\]*_]*(?=\s|$)")
FENCE = re.compile(r"^\s*(```|~~~)")
ATX = re.compile(r"^(#{1,6})(\s|$)")


def section_body(text: str, cut_short: bool = False) -> str:
    """A section's text as the article shows it: without the leading heading (the article sets its own) or
    the model's opener ("Sure! Here is section 2:"); when the model was cut off by its token budget
    (cut_short), ending at its last full sentence, as long as that keeps most of the text."""
    lines = text.strip().splitlines()
    while lines and (not lines[0].strip() or ATX.match(lines[0].lstrip()) or OPENER.match(lines[0].strip())
                     or _bold_line(lines[0])):
        lines.pop(0)
    body = "\n".join(lines).strip()
    if cut_short and body:
        ends = [m.end() for m in SENTENCE_END.finditer(body)]
        if ends and ends[-1] >= len(body) // 2:
            body = body[:ends[-1]]
    return body


def _bold_line(line: str) -> bool:
    """A line that is all bold and short: a heading written as **Heading**."""
    stripped = line.strip()
    return (stripped.startswith("**") and stripped.endswith("**") and len(stripped) > 4
            and len(stripped.split()) <= 12)


def demote_headings(text: str, top: int) -> str:
    """Markdown whose ATX headings (outside code fences) start at level `top`, keeping their relative depth."""
    lines, fenced, levels = text.splitlines(), False, []
    for line in lines:
        fenced ^= bool(FENCE.match(line))
        if not fenced and (m := ATX.match(line)):
            levels.append(len(m.group(1)))
    if not levels or min(levels) >= top:
        return text
    shift, fenced, out = top - min(levels), False, []
    for line in lines:
        fenced ^= bool(FENCE.match(line))
        m = None if fenced else ATX.match(line)
        out.append("#" * min(6, len(m.group(1)) + shift) + line[len(m.group(1)):] if m else line)
    return "\n".join(out)
