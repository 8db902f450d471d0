"""python -m mcp_server: serve MCP over stdio (default) or streamable HTTP (--http); install/uninstall."""

import argparse
import json
import os
import sys
from pathlib import Path

from common.settings import Settings, SettingsError
from mcp_server import toolsets
from mcp_server.client_entries import CLIENTS, SCOPES


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mcp_server", description="Scriptorium's MCP server")
    parser.add_argument("--http", action="store_true", help="serve streamable HTTP at /mcp instead of stdio")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8765)
    parser.add_argument("--budget", type=float, default=None,
                        help="seconds a tool call may block before it returns a job id (agents give up near 60; "
                             "default 45 or SCRIPTORIUM_MCP_BUDGET)")
    parser.add_argument("--toolsets", default=None, metavar="NAMES",
                        help=f"comma-separated toolsets to list: {', '.join(toolsets.NAMES)} (default core or "
                             "SCRIPTORIUM_MCP_TOOLSETS)")
    sub = parser.add_subparsers(dest="command")
    for name in ("install", "uninstall"):
        p = sub.add_parser(name, help=f"{name} the 'scriptorium' entry in an agent's MCP configuration")
        p.add_argument("--client", required=True, choices=CLIENTS)
        p.add_argument("--scope", default="user", choices=SCOPES,
                       help="user (every project), project (a file in the project, to commit) or local (Claude "
                            "Code: this project, only you)")
        p.add_argument("--project-dir", default=".", help="the project for --scope project/local (default: here)")
        p.add_argument("--no-cli", dest="use_cli", action="store_false", default=None,
                       help="edit ~/.claude.json directly even when the claude CLI is on PATH")
        if name == "install":
            p.add_argument("--http", dest="http_url", default=None, metavar="URL",
                           help="register the HTTP server at URL (e.g. http://127.0.0.1:8765/mcp) instead of stdio")
            p.add_argument("--print", dest="dry_run", action="store_true", help="show the entry, write nothing")
            p.add_argument("--toolsets", dest="entry_toolsets", default=None, metavar="NAMES",
                           help="the toolsets the entry's server lists (stdio: written as --toolsets)")
        p.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)

    try:
        picked = toolsets.parse(args.toolsets) if args.toolsets is not None else None
        settings = Settings.from_env(mcp_toolsets=picked)
        toolsets.chosen(settings.mcp_toolsets)
        entry_toolsets = getattr(args, "entry_toolsets", None)
        entry_toolsets = toolsets.parse(entry_toolsets) if entry_toolsets is not None else None
    except (SettingsError, toolsets.ToolsetError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.command in ("install", "uninstall"):
        from mcp_server.install import InstallError, install, uninstall

        try:
            if args.command == "install":
                result = install(args.client, args.scope, Path(args.project_dir), args.http_url,
                                 bool(settings.mcp_token), args.dry_run, args.use_cli, entry_toolsets)
            else:
                result = uninstall(args.client, args.scope, Path(args.project_dir), args.use_cli)
        except InstallError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        if args.command == "install" and args.http_url is None and not args.dry_run:
            result["notes"] += _prime(entry_toolsets)
        if args.json:
            print(json.dumps(result))
        elif result.get("snippet"):
            print(f"# {result['path']}\n{result['snippet']}")
        elif not result["changed"]:
            print(f"nothing to do: {result['path']} already {'has' if args.command == 'install' else 'lacks'} "
                  "the scriptorium entry")
        else:
            verb = "installed scriptorium in" if args.command == "install" else "removed scriptorium from"
            backup = f" (backup: {result['backup']})" if result.get("backup") else ""
            print(f"{verb} {result['path']}{backup}")
        if not args.json:
            for note in result.get("notes", []):
                print(f"note: {note}")
        return 0

    if args.http:  # imported here: under stdio, every import delays the answer to `initialize`
        _log_to_stderr()
        from mcp_server.http import serve_http

        return serve_http(settings, args.host, args.port, args.budget)
    from mcp_server.answers_file import locate
    from mcp_server.stdio_front import Front

    def load():
        _log_to_stderr()
        from mcp_server.server import build_server

        server = build_server(settings, budget=args.budget)
        return lambda: server.run("stdio")

    from mcp_server.job_resources import resources_list

    live = {"resources/list": lambda: resources_list(settings)}
    return Front(locate(settings.home, settings.mcp_toolsets, args.budget), load, settings.mcp_toolsets, live).serve()


def _log_to_stderr() -> None:
    import logging

    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)  # stdout carries the protocol under stdio


def _prime(entry_toolsets: tuple[str, ...] | None) -> list[str]:
    """The entry's server started once here, so that the agent's first start answers at once."""
    from mcp_server.client_entries import stack_env
    from mcp_server.stdio_prime import prime

    command = [sys.executable, "-m", "mcp_server", *(["--toolsets", ",".join(entry_toolsets)] if entry_toolsets else [])]
    problems = prime(command, {**os.environ, **stack_env()}, cwd=Path(__file__).resolve().parents[1])
    return [f"the server's first answers are not remembered yet: {p}" for p in problems]


if __name__ == "__main__":
    sys.exit(main())
