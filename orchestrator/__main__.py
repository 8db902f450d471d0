"""python -m orchestrator: run, list, show, resume, cancel (and work, the detached worker); create, research,
write, illustrate and assemble for a shared run's stages one at a time."""

import argparse
import asyncio
import contextlib
import json
import os
import sys
import time

from common.settings import Settings, SettingsError
from orchestrator import api, pool, run_cli
from orchestrator.clients.comfyui import ComfyUIError, Interrupted
from orchestrator.clients.llm_client import LLMError
from orchestrator.jobs import JobError, JobStore
from orchestrator.pipeline.article import ArticleRun, Cancelled, Reporter
from orchestrator.pipeline.image import run_image
from orchestrator.pipeline.params import ArticleParams, ParamsError
from orchestrator.pipeline.research import ResearchError
from orchestrator.pipeline.stage_job import run_stage
from orchestrator.pipeline.stages import StageError
from orchestrator.run_edits import EditError
from orchestrator.workflows import TemplateError

USER_ERRORS = (SettingsError, JobError, ParamsError, LLMError, ComfyUIError, ResearchError, TemplateError, Cancelled,
               StageError, EditError)


class BarReporter(Reporter):
    """One rich progress bar per stage."""

    def __init__(self, progress):
        self.progress = progress
        self.tasks: dict[str, int] = {}

    def stage(self, name: str, total: int) -> None:
        if name not in self.tasks:
            self.tasks[name] = self.progress.add_task(name, total=max(total, 1))
            if total == 0:
                self.progress.update(self.tasks[name], completed=1)

    def advance(self, name: str) -> None:
        self.progress.advance(self.tasks[name])

    def detail(self, text: str) -> None:
        if "illustration" in self.tasks:
            self.progress.update(self.tasks["illustration"], description=f"illustration ({text})")


def _execute(store: JobStore, run_id: str, settings: Settings, quiet: bool) -> dict:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    columns = (TextColumn("{task.description:<32}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, disable=quiet or not sys.stderr.isatty(), transient=False) as progress:
        return asyncio.run(ArticleRun(store, run_id, settings, BarReporter(progress)).execute())


def _print_run(run: dict, as_json: bool) -> None:
    if as_json:
        print(json.dumps(run, indent=2, default=str))
        return
    state = "interrupted (resume it)" if run.get("interrupted") else run["status"]
    if run.get("queue_position"):
        state += f" (number {run['queue_position']} in the queue for a worker)"
    print(f"run       {run['id']}\nstatus    {state}\nstage     {run.get('stage') or '-'}\n"
          f"progress  {run['progress'] * 100:.0f}%\ntopic     {_about(run['params'])}")
    if run.get("error"):
        print(f"error     {run['error']}")
    if (run.get("result") or {}).get("article_html"):
        print(f"article   {run['result']['article_html']}")
        if run["result"].get("images_skipped"):
            print(f"note      {run['result']['images_skipped']}")
    for step in run.get("steps", []):
        took = f"{step['finished'] - step['started']:.1f}s" if step.get("finished") and step.get("started") else ""
        print(f"  {step['name']:<16} {step['status']:<8} {took:>8}  {step.get('error') or ''}")


def _about(params: dict) -> str:
    """What a run is about: an article's topic, an image's prompt, a stage job's stage and run."""
    if params.get("stage"):
        return f"{params['stage']} of {params['run_id']}"
    return params.get("topic") or params.get("prompt") or params.get("template") or ""


def _resolve(store: JobStore, typed: str) -> str:
    """At the CLI a unique prefix of an id will do (people type them from `list`); the run it names is said."""
    run = store.find(typed)
    if run.id != typed:
        print(f"{typed}: run {run.id}", file=sys.stderr)
    return run.id


def _move_queue(take_next: bool) -> None:
    """After a job ends here: start the jobs waiting for a worker. take_next: this process is a pool worker and
    becomes the worker of the next one itself (so the pool never holds more processes than max_jobs)."""
    with contextlib.suppress(SettingsError, JobError, OSError):
        settings = Settings.from_env()
        store = JobStore(settings.jobs_db)
        if not take_next:
            pool.settle(store, settings)
        elif (run_id := pool.dispatch(store, settings, keep_one=True)) is not None:
            pool.become(run_id, settings)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m orchestrator", description="Scriptorium's content pipelines")
    sub = parser.add_subparsers(dest="command", required=True)
    run_p = sub.add_parser("run", help="write an article (in the foreground, with progress bars)")
    run_p.add_argument("topic")
    run_p.add_argument("--audience", default="general readers")
    run_p.add_argument("--sections", type=int, default=4)
    run_p.add_argument("--words", type=int, default=150, help="words per section")
    run_p.add_argument("--images", type=int, default=2)
    run_p.add_argument("--source", action="append", default=[], help="a text/Markdown file to ground the research")
    run_p.add_argument("--template", default="sd15", help="sd15, sdxl, flux, or an API-format workflow file")
    run_p.add_argument("--seed", type=int, default=None)
    run_p.add_argument("--temperature", type=float, default=0.7)
    run_p.add_argument("--sampling", type=json.loads, default={}, metavar="JSON",
                       help='per-stage sampling overrides, e.g. \'{"sections": {"repetition_penalty": 1.3}}\'')
    run_p.add_argument("--model", default=None, help="the model name on the LLM server (default: its first)")
    run_p.add_argument("--llm", default=None, help="an OpenAI-compatible base URL (default: SCRIPTORIUM_LLM_URL)")
    run_p.add_argument("--comfyui", default=None, help="ComfyUI's URL (default: SCRIPTORIUM_COMFYUI_URL)")
    run_p.add_argument("--detach", action="store_true", help="start the run in the background and print its id")
    run_p.add_argument("--json", action="store_true")
    for name, text in (("show", "one run and its steps"), ("resume", "continue an interrupted or failed run"),
                       ("cancel", "cancel a run (between steps; interrupts ComfyUI)")):
        p = sub.add_parser(name, help=text)
        p.add_argument("run_id")
        p.add_argument("--json", action="store_true")
    list_p = sub.add_parser("list", help="recent runs")
    list_p.add_argument("--limit", type=int, default=20)
    list_p.add_argument("--json", action="store_true")
    run_cli.add_parsers(sub)
    work_p = sub.add_parser("work", help=argparse.SUPPRESS)
    work_p.add_argument("run_id")
    args = parser.parse_args(argv)
    code = _command(args)
    if args.command in ("work", "run", "resume", *run_cli.STAGE_COMMANDS):
        _move_queue(take_next=args.command == "work")
    return code


def _command(args: argparse.Namespace) -> int:
    try:
        settings = Settings.from_env()
        store = JobStore(settings.jobs_db)
        if getattr(args, "run_id", None) is not None and args.command != "work":  # the worker gets exact ids
            args.run_id = _resolve(store, args.run_id)
        if args.command == "run":
            params = ArticleParams(
                topic=args.topic, audience=args.audience, sections=args.sections, words_per_section=args.words,
                images=args.images, sources=args.source, template=args.template, seed=args.seed,
                temperature=args.temperature, llm_url=args.llm, comfyui_url=args.comfyui, model=args.model,
                sampling=args.sampling,
            )
            if args.detach:
                run = pool.enqueue(store, "article", params.to_dict(), settings, "cli")
                if args.json:
                    print(json.dumps({"run_id": run.id, "status": run.status, "queue_position": run.queue_position}))
                else:
                    print(run.id)
                return 0
            run = store.create_run("article", params.to_dict(), status="running", client="cli", pid=os.getpid())
            started = time.monotonic()
            result = _execute(store, run.id, settings, quiet=args.json)
            if args.json:
                print(json.dumps({"run_id": run.id, "seconds": round(time.monotonic() - started, 1), **result}))
            else:
                if result.get("images_skipped"):
                    print(f"note: {result['images_skipped']}", file=sys.stderr)
                print(result["article_html"])
            return 0
        if args.command in run_cli.COMMANDS:
            return run_cli.handle(args, settings, store)
        if args.command == "work":
            run = store.get(args.run_id)
            if run.kind == "image":
                asyncio.run(run_image(store, run.id, settings))
            elif run.kind == "stage":
                asyncio.run(run_stage(store, run.id, settings))
            else:
                asyncio.run(ArticleRun(store, run.id, settings).execute())
            return 0
        if args.command == "resume":
            run = store.get(args.run_id)
            if run.kind == "stage":  # a stage job whose worker died: the same stage again, only what is missing
                result = asyncio.run(run_stage(store, run.id, settings))
                print(json.dumps({"job_id": run.id, **result}) if args.json else result["summary"])
                return 0
            result = _execute(store, run.id, settings, quiet=args.json)
            print(json.dumps({"run_id": run.id, **result}) if args.json else result["article_html"])
            return 0
        if args.command == "show":
            shown = api.status(args.run_id, settings)
            parts = api.get_run(shown["id"], settings) if shown["kind"] == "article" else None
            if args.json:
                print(json.dumps({**shown, **({"run": parts} if parts else {})}, indent=2, default=str))
                return 0
            _print_run(shown, False)
            if parts:
                run_cli.print_parts(parts)
            return 0
        if args.command == "cancel":
            run = store.request_cancel(args.run_id)
            _print_run(api.get(run.id, settings).to_dict(), args.json)
            return 0
        if args.command == "list":
            runs = api.list_runs(args.limit, settings)
            if args.json:
                print(json.dumps({"runs": runs}, indent=2, default=str))
            elif not runs:
                print("no runs yet")
            else:
                for r in runs:
                    state = "interrupted" if r["interrupted"] else r["status"]
                    if r.get("queue_position"):
                        state = f"queued #{r['queue_position']}"
                    print(f"{r['id']}  {state:<11} {r['progress'] * 100:4.0f}%  {_about(r['params'])[:60]}")
            return 0
    except (Cancelled, Interrupted):
        print("cancelled", file=sys.stderr)
        return 3
    except USER_ERRORS as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except OSError as e:  # a file of the run or the data directory that cannot be read or written
        where = f" {e.filename}" if e.filename else ""
        print(f"error:{where}: {e.strerror or e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted; `python -m orchestrator resume` continues the run", file=sys.stderr)
        return 130
    return 2


if __name__ == "__main__":
    sys.exit(main())
