"""article.html from hostile model text: an oracle parses the page as a browser would tokenize it and looks for
anything that could run; the Markdown a model normally writes must still render."""

import base64
import io
import re
from html.parser import HTMLParser

from PIL import Image

from orchestrator.pipeline.assembly import article_html

HOSTILE = [
    "<script>alert('raw')</script>",
    "Text <img src=x onerror=alert(1)> inline, <svg onload=alert(2)></svg> and <b onclick=alert(3)>bold</b>.",
    '<iframe src="https://evil.example/"></iframe>\n\n<style>body { display: none }</style>',
    '<div onmouseover="alert(4)">\nblock\n</div>\n\n<!-- <script>alert(5)</script> -->',
    "[plain](javascript:alert(6)) [upper](JaVaScRiPt:alert(7)) [tab](java\tscript:alert(8))",
    "[entity](&#106;avascript:alert(9)) [hex](&#x6A;avascript:alert(10)) [spaced]( javascript:alert(11))",
    "[vb](vbscript:msgbox(12)) [page](data:text/html;base64,PHNjcmlwdD5hbGVydCgxMyk8L3NjcmlwdD4=)",
    "![pic](javascript:alert(14)) ![svg](data:image/svg+xml;base64,PHN2Zz48L3N2Zz4=) <javascript:alert(15)>",
    "[ref][x] and a heading attribute\n\n[x]: javascript:alert(16)\n\n## Inside {: onclick=\"alert(17)\" }",
    "<a href=\"javascript:alert(18)\">anchor</a> <form action=\"https://evil.example\"><input></form>",
]

NORMAL = """## A subheading

Some *emphasis*, some **strength**, a [link](https://example.org/page?a=1&b=2) and [another](http://example.com),
and `code with <tags>` kept as text.

- first item
- second item

Then in order:

1. one
2. two

| a | b |
|:--|--:|
| 1 | 2 |

```
<script>not run, shown</script>
```
"""

DANGEROUS_TAGS = {"script", "iframe", "object", "embed", "svg", "math", "form", "input", "base", "link", "frame"}


class Oracle(HTMLParser):
    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.elements: list[tuple[str, dict]] = []
        self.text: list[str] = []

    def handle_starttag(self, tag, attrs):
        self.elements.append((tag, dict(attrs)))

    def handle_data(self, data):
        self.text.append(data)


def parse(page: str) -> Oracle:
    oracle = Oracle()
    oracle.feed(page)
    oracle.close()
    return oracle


def scheme(url: str) -> str:
    match = re.match(r"([a-z][a-z0-9+.\-]*):", re.sub(r"[\x00-\x20\x7f]+", "", url).lower())
    return match.group(1) if match else ""


def png() -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (8, 8), (200, 10, 10)).save(buffer, format="PNG")
    return buffer.getvalue()


def build(tmp_path, texts: list[str]) -> tuple[str, bytes]:
    (tmp_path / "images").mkdir()
    data = png()
    (tmp_path / "images" / "00.png").write_bytes(data)
    outline = {"title": "A <b>title</b>", "sections": [{"heading": f"Part {i}"} for i in range(len(texts))]}
    images = {0: {"file": "images/00.png", "prompt": 'a "quoted" <prompt>'}}
    return article_html(outline, texts, images, tmp_path, note=None), data


def test_hostile_markdown_cannot_run_anything(tmp_path):
    page, data = build(tmp_path, HOSTILE)
    oracle = parse(page)
    tags = [tag for tag, _ in oracle.elements]
    assert not DANGEROUS_TAGS & set(tags)
    assert tags.count("style") == 1 and tags.index("style") < tags.index("body")  # only the page's own, in head
    own_image = f"data:image/png;base64,{base64.b64encode(data).decode()}"
    for tag, attrs in oracle.elements:
        assert not [name for name in attrs if name.startswith("on")], (tag, attrs)
        assert "style" not in attrs and "action" not in attrs and "formaction" not in attrs
        for name in ("href", "src"):
            if name in attrs:
                assert scheme(attrs[name]) in ("", "http", "https", "mailto") or attrs[name] == own_image, attrs
    assert sum(1 for tag, attrs in oracle.elements if attrs.get("src") == own_image) == 1
    text = "".join(oracle.text)
    assert "<script>alert('raw')</script>" in text  # shown as text, not dropped without a trace
    assert "<b onclick=alert(3)>" in text


def test_normal_markdown_still_renders(tmp_path):
    page, data = build(tmp_path, [NORMAL])
    oracle = parse(page)
    tags = [tag for tag, _ in oracle.elements]
    for tag in ("h1", "h2", "h3", "em", "strong", "ul", "ol", "li", "code", "pre", "table", "th", "td", "figure", "img"):
        assert tag in tags, tag
    # the section's heading is the page's only h2: the model's "## A subheading" goes under it
    assert tags.count("h2") == 1 and tags.count("h3") == 1
    links = [attrs["href"] for tag, attrs in oracle.elements if tag == "a"]
    assert links == ["https://example.org/page?a=1&b=2", "http://example.com"]
    assert {attrs.get("align") for tag, attrs in oracle.elements if tag == "th"} == {"left", "right"}
    text = "".join(oracle.text)
    assert "<script>not run, shown</script>" in text and "code with <tags>" in text
    assert "A <b>title</b>" in text and 'a "quoted" <prompt>' in text
    assert "script" not in tags


def test_a_sections_headings_of_any_level_and_form_sit_under_its_own(tmp_path):
    text = "Intro.\n\nBig one\n=======\n\nbody\n\n## Second\n\nmore\n\n#### Deep\n"
    page, _ = build(tmp_path, [text])
    tags = [tag for tag, _ in parse(page).elements]
    assert tags.count("h1") == 1 and tags.count("h2") == 1  # the article's title and the section's heading
    assert [t for t in tags if t in ("h3", "h4", "h5", "h6")] == ["h3", "h4", "h6"]
