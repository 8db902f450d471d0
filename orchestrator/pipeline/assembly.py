"""Assembly: article.md and a standalone article.html (images embedded), and ffmpeg post-processing."""

import base64
import html
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

from orchestrator.pipeline import safe_html
from orchestrator.pipeline.prose import demote_headings

STYLE = """
body { font-family: Georgia, 'Times New Roman', serif; max-width: 46rem; margin: 3rem auto; padding: 0 1rem;
       line-height: 1.6; color: #222; background: #fdfbf7; }
h1 { font-size: 2.2rem; line-height: 1.2; } h2 { margin-top: 2.5rem; }
figure { margin: 1.5rem 0; } figure img { width: 100%; height: auto; border-radius: 4px; }
figcaption { font-size: 0.85rem; color: #666; } footer { margin-top: 3rem; font-size: 0.8rem; color: #888; }
"""
SECTION_SUBHEADING = 3  # the title is h1, each section's heading h2: a heading the model writes goes under it


def article_markdown(outline: dict, texts: list[str], images: dict[int, dict]) -> str:
    parts = [f"# {outline['title']}\n"]
    for i, (section, text) in enumerate(zip(outline["sections"], texts)):
        parts.append(f"## {section['heading']}\n")
        if i in images:
            parts.append(f"![{images[i]['prompt']}]({images[i]['file']})\n")
        parts.append(demote_headings(text.strip(), SECTION_SUBHEADING) + "\n")
    return "\n".join(parts)


def article_html(outline: dict, texts: list[str], images: dict[int, dict], run_dir: Path, note: str | None) -> str:
    body = [f"<h1>{html.escape(outline['title'])}</h1>"]
    for i, (section, text) in enumerate(zip(outline["sections"], texts)):
        body.append(f"<h2>{html.escape(section['heading'])}</h2>")
        if i in images:
            data = base64.b64encode((run_dir / images[i]["file"]).read_bytes()).decode()
            body.append(f'<figure><img src="data:image/png;base64,{data}" alt="{html.escape(images[i]["prompt"])}">'
                        f"<figcaption>{html.escape(images[i]['prompt'])}</figcaption></figure>")
        # the model's raw HTML shows as text; no script runs
        body.append(safe_html.markdown_html(text, SECTION_SUBHEADING))
    footer = "Written by Scriptorium." + (f" {html.escape(note)}" if note else "")
    return (f"<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">"
            f"<title>{html.escape(outline['title'])}</title><style>{STYLE}</style></head>\n<body>\n"
            + "\n".join(body) + f"\n<footer>{footer}</footer>\n</body></html>\n")


def postprocess(run_dir: Path, image_files: list[str], save: Callable[[str, bytes], str]) -> dict:
    """Web-sized JPEG copies (at most 1024 px wide) and a 320 px thumbnail of the first image.
    save(relative, data) writes each file into the run directory (atomically) and returns its name."""
    if not image_files:  # said first: without images, whether ffmpeg is installed does not matter
        return {"skipped": "no images to process"}
    ffmpeg = shutil.which("ffmpeg")
    if ffmpeg is None:
        return {"skipped": "ffmpeg is not installed"}
    web = [save(f"images/web/{Path(name).stem}.jpg", _ffmpeg(ffmpeg, run_dir / name, "scale='min(1024,iw)':-2"))
           for name in image_files]
    thumbnail = save("thumbnail.jpg", _ffmpeg(ffmpeg, run_dir / image_files[0], "scale=320:-2"))
    return {"web": web, "thumbnail": thumbnail}


def _ffmpeg(ffmpeg: str, source: Path, scale: str) -> bytes:
    """The JPEG ffmpeg makes of source; it writes into a scratch directory, never under a run output's name."""
    with tempfile.TemporaryDirectory(prefix="scriptorium-ffmpeg-") as scratch:
        target = Path(scratch) / "out.jpg"
        result = subprocess.run([ffmpeg, "-y", "-loglevel", "error", "-i", str(source), "-vf", scale, "-q:v", "3",
                                 str(target)], capture_output=True, text=True, timeout=120)
        if result.returncode != 0:
            raise RuntimeError(f"ffmpeg could not convert {source.name}: {result.stderr.strip()[-300:]}")
        return target.read_bytes()
