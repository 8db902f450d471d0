"""The jobs as MCP resources, without the MCP SDK: each job's URIs and status, and the resources/list result
(the recent jobs and their files, as the spec's Resource objects in JSON).

Claude Code offers none of a server's tools until it has its tools, prompts and resources lists: the stdio front
(stdio_front.py) answers resources/list with this before the SDK has loaded, as the SDK server does after."""

from pathlib import Path

from common.settings import Settings

LISTED = 50  # jobs resources/list shows
PREFIX = "scriptorium://jobs/"
MIME_TYPES = {".md": "text/markdown", ".html": "text/html"}  # a job's other files are its PNG images


def job_uri(job_id: str) -> str:
    return PREFIX + job_id


def job_status(run) -> str:
    return "interrupted" if run.interrupted else run.status


def job_uris(run) -> list[str]:
    """The job's own resource, then its article (markdown and HTML) and its images, as far as it has them."""
    uris = [job_uri(run.id)]
    result = run.result or {}
    if result.get("article_md"):
        uris += [f"{job_uri(run.id)}/article.md", f"{job_uri(run.id)}/article.html"]
    return uris + [f"{job_uri(run.id)}/images/{Path(p).name}" for p in result.get("images", [])]


def resources_list(settings: Settings) -> dict:
    """The resources/list result: the LISTED most recent jobs, each followed by its files."""
    # Imported here, by the front's thread while the SDK's loads (a plain import: Python 3.11's LazyLoader is not
    # safe across threads); the listing's own module, as orchestrator.api's pipelines take seconds to import.
    from orchestrator.job_pages import page

    runs, _ = page(LISTED, None, settings)
    resources = []
    for run in runs:
        params = run.params
        about = (
            params.get("topic")
            or params.get("prompt")
            or params.get("stage")
            or Path(params.get("template", "")).name
        )
        resources.append(
            {
                "uri": job_uri(run.id),
                "name": run.id,
                "title": f"{run.kind}: {about} ({job_status(run)})",
                "mimeType": "application/json",
            }
        )
        for uri in job_uris(run)[1:]:
            resources.append(
                {
                    "uri": uri,
                    "name": uri.rsplit("/", 1)[-1],
                    "mimeType": MIME_TYPES.get(Path(uri).suffix, "image/png"),
                }
            )
    return {"resources": resources}
