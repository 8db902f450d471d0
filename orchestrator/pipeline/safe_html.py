"""The model's Markdown as HTML that cannot run anything in the reader's browser.

Two layers. Markdown is rendered with raw HTML switched off (an HTML block or tag in the model's text
is shown as text) and without attr_list (which would let `{: onclick=...}` set any attribute). Then the
HTML is rebuilt from a parse, keeping only the elements and attributes Markdown makes and only link and
image URLs with safe schemes: the parse decodes entities as a browser does, so `&#106;avascript:` is
judged as the `javascript:` the browser would see.
"""

import html
import re
from html.parser import HTMLParser

import markdown

# Python-Markdown's "extra" minus attr_list and md_in_html.
EXTENSIONS = ["tables", "fenced_code", "footnotes", "def_list", "abbr"]
EXTENSION_CONFIG = {"tables": {"use_align_attribute": True}}  # align="left", not a style attribute

TAGS = {"p", "br", "hr", "h1", "h2", "h3", "h4", "h5", "h6", "em", "strong", "b", "i", "code", "pre", "blockquote",
        "ul", "ol", "li", "a", "img", "table", "thead", "tbody", "tr", "th", "td", "sup", "sub", "div", "dl", "dt",
        "dd", "abbr", "del", "ins", "span"}
VOID = {"br", "hr", "img"}
DROPPED_WITH_CONTENT = {"script", "style", "iframe", "object", "embed", "template", "noscript", "textarea", "title",
                        "svg", "math", "select", "head"}
COMMON_ATTRS = {"id", "class", "title"}
TAG_ATTRS = {"a": {"href"}, "img": {"src", "alt"}, "ol": {"start"}, "th": {"align"}, "td": {"align"}}
URL_SCHEMES = {"href": {"http", "https", "mailto"}, "src": {"http", "https"}}  # no data: from the model
ALIGN = {"left", "right", "center"}
HEADING = re.compile(r"<h([1-6])[ >]")
HEADING_TAG = re.compile(r"<(/?)h([1-6])(?=[ >])")


def markdown_html(text: str, top_heading: int = 1) -> str:
    """text (Markdown from the model) as a safe HTML fragment whose headings start at level top_heading (a
    section's own headings sit under the section's <h2>, whatever level the model chose, setext ones too)."""
    md = markdown.Markdown(extensions=EXTENSIONS, extension_configs=EXTENSION_CONFIG)
    md.preprocessors.deregister("html_block")
    md.inlinePatterns.deregister("html")
    fragment = sanitise(md.convert(text))
    levels = [int(level) for level in HEADING.findall(fragment)]
    if not levels or min(levels) >= top_heading:
        return fragment
    shift = top_heading - min(levels)
    # the fragment is rebuilt by sanitise, so every heading tag in it is one this pattern matches
    return HEADING_TAG.sub(lambda m: f"<{m.group(1)}h{min(6, int(m.group(2)) + shift)}", fragment)


def sanitise(fragment: str) -> str:
    """fragment with only the allowed elements, attributes and URLs; everything else as text or gone."""
    cleaner = _Cleaner()
    cleaner.feed(fragment)
    cleaner.close()
    return "".join(cleaner.out)


def url_allowed(value: str, attribute: str) -> bool:
    # Browsers ignore control characters and spaces around and inside a scheme ("java\tscript:").
    squeezed = re.sub(r"[\x00-\x20\x7f]+", "", value)
    scheme = re.match(r"([A-Za-z][A-Za-z0-9+.\-]*):", squeezed)
    return scheme is None or scheme.group(1).lower() in URL_SCHEMES[attribute]


class _Cleaner(HTMLParser):
    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.out: list[str] = []
        self.dropping = 0  # depth inside elements whose content goes too

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag in DROPPED_WITH_CONTENT:
            self.dropping += 1
            return
        if self.dropping or tag not in TAGS:
            return
        kept = []
        for name, value in attrs:
            if name not in COMMON_ATTRS | TAG_ATTRS.get(tag, set()) or value is None:
                continue
            if name in URL_SCHEMES and not url_allowed(value, name):
                continue
            if name == "align" and value.lower() not in ALIGN:
                continue
            if name == "start" and not value.isdigit():
                continue
            kept.append(f' {name}="{html.escape(value, quote=True)}"')
        self.out.append(f"<{tag}{''.join(kept)}>")

    def handle_startendtag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.handle_starttag(tag, attrs)
        if tag not in VOID:
            self.handle_endtag(tag)

    def handle_endtag(self, tag: str) -> None:
        if tag in DROPPED_WITH_CONTENT:
            self.dropping = max(self.dropping - 1, 0)
        elif not self.dropping and tag in TAGS and tag not in VOID:
            self.out.append(f"</{tag}>")

    def handle_data(self, data: str) -> None:
        if not self.dropping:
            self.out.append(html.escape(data, quote=False))
