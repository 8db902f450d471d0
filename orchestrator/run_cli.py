"""The shared-run commands of `python -m orchestrator`: create, research, write, illustrate, assemble (each stage
done in the foreground, recorded in the run's history as the CLI's), and the run's parts for `show`."""

import argparse
import asyncio
import json

from common.settings import Settings
from orchestrator import api
from orchestrator.history import Actor
from orchestrator.jobs import JobStore
from orchestrator.pipeline.stage_job import run_stage

STAGE_COMMANDS = ("research", "write", "illustrate", "assemble")
COMMANDS = ("create", *STAGE_COMMANDS)


def add_parsers(sub) -> None:
    create = sub.add_parser(
        "create", help="create a shared run whose stages agents or people do one at a time"
    )
    create.add_argument("topic")
    create.add_argument("--audience", default="general readers")
    create.add_argument("--length", choices=("short", "medium", "long"), default="short")
    create.add_argument("--style", default=None)
    create.add_argument("--sections", type=int, default=None)
    create.add_argument("--images", type=int, default=None)
    create.add_argument("--words", type=int, default=None, help="words per section")
    create.add_argument(
        "--source", action="append", default=[], help="a text/Markdown file to ground the research"
    )
    create.add_argument("--seed", type=int, default=None)
    create.add_argument("--json", action="store_true")
    research = _stage_parser(sub, "research", "make the outline of a shared run")
    research.add_argument("--instructions", default=None)
    research.add_argument("--redo", action="store_true", help="a new outline even if one stands")
    write = _stage_parser(sub, "write", "write the sections not yet written (or one, with --section)")
    write.add_argument("--section", type=int, default=None, help="only this section (0 for the first)")
    write.add_argument("--instructions", default=None, help="with --section: what to change")
    write.add_argument("--redo", action="store_true")
    illustrate = _stage_parser(sub, "illustrate", "render the images not yet made (or one, with --section)")
    illustrate.add_argument("--section", type=int, default=None)
    illustrate.add_argument("--prompt", default=None)
    illustrate.add_argument("--template", default=None)
    illustrate.add_argument("--checkpoint", default=None)
    illustrate.add_argument("--redo", action="store_true")
    assemble = _stage_parser(sub, "assemble", "assemble the article from the parts as they stand")
    assemble.add_argument(
        "--format", action="append", choices=("md", "html"), default=None, help="md, html (default both)"
    )
    assemble.add_argument("--no-post-process", action="store_true", help="no web-sized images or thumbnail")


def _stage_parser(sub, name: str, text: str) -> argparse.ArgumentParser:
    parser = sub.add_parser(name, help=text)
    parser.add_argument("run_id")
    parser.add_argument("--json", action="store_true")
    return parser


def handle(args: argparse.Namespace, settings: Settings, store: JobStore) -> int:
    if args.command == "create":
        params = {
            "topic": args.topic,
            "audience": args.audience,
            "length": args.length,
            "style": args.style,
            "sections": args.sections,
            "images": args.images,
            "words_per_section": args.words,
            "sources": args.source,
            "seed": args.seed,
        }
        run = api.create_run({k: v for k, v in params.items() if v is not None}, settings)
        print(json.dumps({"run_id": run.id, **run.params}) if args.json else run.id)
        return 0
    stage, stage_args = _stage(args)
    job = api.create_stage_job(args.run_id, stage, stage_args, Actor("cli", args.command), settings)
    result = asyncio.run(run_stage(store, job.id, settings))
    if args.json:
        print(json.dumps({"job_id": job.id, **result}))
    elif result.get("article"):
        print(result["article"]["article_html"] or result["article"]["article_md"])
    else:
        print(result["summary"])
    return 0


def _stage(args: argparse.Namespace) -> tuple[str, dict]:
    if args.command == "research":
        return "research", {"instructions": args.instructions, "redo": args.redo or None}
    if args.command == "write":
        if args.section is None:
            if args.instructions:
                raise api.ParamsError("--instructions goes with --section: say which section to change")
            return "write_sections", {"redo": args.redo or None}
        return "write_section", {
            "index": args.section,
            "instructions": args.instructions,
            "redo": args.redo or None,
        }
    if args.command == "illustrate":
        return "illustrate", {
            "index": args.section,
            "prompt": args.prompt,
            "template": args.template,
            "checkpoint": args.checkpoint,
            "redo": args.redo or None,
        }
    return "assemble", {"formats": args.format or ["md", "html"], "post_process": not args.no_post_process}


def print_parts(state: dict) -> None:
    """The shared run's parts, one line each, after `show`'s summary."""
    outline = state["outline"]
    print(f"outline   v{outline['version']} {_status(outline)}  {outline['title'] or ''}")
    for s in state["sections"]:
        print(
            f"  section {s['index']}  v{s['version']} {_status(s):<8} {s['words']:>4} words  {s['heading'] or ''}"
        )
    for i in state["images"]:
        print(f"  image {i['index']}    v{i['version']} {_status(i):<8} {i['file'] or i['skipped'] or ''}")
    out = state["outputs"]
    print(f"article   v{out['version']} {_status(out)}  {out['html'] or out['markdown'] or ''}")


def _status(part: dict) -> str:
    by = part.get("changed_by")
    return part["status"] + (f" ({by['client']})" if by else "")
