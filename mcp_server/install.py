"""`python -m mcp_server install|uninstall --client NAME`: our entry in an agent's MCP configuration.

Changes merge into the file without touching other entries (or, in JSON files, any other byte),
keep a timestamped backup of the previous file, do nothing when the entry is already there, and
refuse to touch a file that does not parse. Claude Code rewrites ~/.claude.json while it runs, so
its user and local scopes go through its own `claude mcp add-json` when the CLI is on PATH.
"""

import json
import shutil
import subprocess
import time
from pathlib import Path

from common.agent_configs import remember
from mcp_server import config_files
from mcp_server.client_entries import CLIENTS, ENTRY, SCOPES, Entry, InstallError, Target, entry, target

__all__ = ["CLIENTS", "SCOPES", "InstallError", "install", "target", "uninstall"]


def _result(t: Target, changed: bool, backup: Path | None = None, notes: list[str] | None = None, **extra) -> dict:
    return {"client": t.client, "scope": t.scope, "path": str(t.path), "changed": changed,
            "backup": str(backup) if backup else None, "notes": notes or [], **extra}


def _claude_cli(t: Target, use_cli: bool | None) -> str | None:
    if t.client != "claude-code" or t.scope == "project" or use_cli is False:
        return None
    found = shutil.which("claude")
    if use_cli and not found:
        raise InstallError("the claude CLI is not on PATH")
    return found


def install(client: str, scope: str = "user", project: Path = Path("."), http_url: str | None = None,
            token_configured: bool = False, dry_run: bool = False, use_cli: bool | None = None,
            toolsets: tuple[str, ...] | None = None) -> dict:
    """token_configured: the server has SCRIPTORIUM_MCP_TOKEN (then the entry refers to it; it never holds it).
    toolsets: what the entry's stdio server lists (None: its default)."""
    t = target(client, scope, project)
    ours = entry(client, scope, http_url, token_configured, toolsets)
    if dry_run:
        return _result(t, False, notes=ours.notes, snippet=config_files.snippet(t, ours.value, ours.inputs))
    text = config_files.read_text(t)
    data = config_files.load(t, text)
    present = config_files.servers(t, data) or {}
    if ENTRY in present and config_files.plain(present[ENTRY]) == ours.value and _inputs_present(data, ours):
        return _result(t, False, notes=ours.notes)
    cli = _claude_cli(t, use_cli)
    if cli:
        backup = _backup(t)
        if ENTRY in present:
            _run(cli, t, "remove", ENTRY, "--scope", t.scope)
        _run(cli, t, "add-json", ENTRY, json.dumps(ours.value), "--scope", t.scope)
    else:
        backup = config_files.write(t, config_files.with_entry(t, text, data, ours.value, ours.inputs))
    remember(t.path)
    return _result(t, True, backup, ours.notes)


def uninstall(client: str, scope: str = "user", project: Path = Path("."), use_cli: bool | None = None) -> dict:
    t = target(client, scope, project)
    if not t.path.exists():
        return _result(t, False)
    text = config_files.read_text(t)
    data = config_files.load(t, text)
    present = config_files.servers(t, data)
    if not present or ENTRY not in present:
        return _result(t, False)
    cli = _claude_cli(t, use_cli)
    if cli:
        backup = _backup(t)
        _run(cli, t, "remove", ENTRY, "--scope", t.scope)
        return _result(t, True, backup)
    inputs = entry(client, scope, "https://example.invalid/mcp").inputs  # ours, by id
    return _result(t, True, config_files.write(t, config_files.with_entry(t, text, data, None, inputs)))


def _inputs_present(data, ours: Entry) -> bool:
    have = data.get("inputs") if isinstance(data.get("inputs"), list) else []
    return all(item in have for item in ours.inputs)


def _backup(t: Target) -> Path | None:
    if not t.path.exists():
        return None
    backup = t.path.with_name(f"{t.path.name}.{time.strftime('%Y%m%d-%H%M%S')}.scriptorium.bak")
    shutil.copy2(t.path, backup)
    return backup


def _run(cli: str, t: Target, *args: str) -> None:
    """`claude mcp ARGS` in the project (local scope is per directory); its own message when it fails."""
    cwd = Path(t.key[1]) if t.scope == "local" else None
    try:
        done = subprocess.run([cli, "mcp", *args], cwd=cwd, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise InstallError(f"`claude mcp {args[0]}` could not run: {e}") from None
    if done.returncode != 0:
        message = (done.stderr or done.stdout).strip().splitlines()
        raise InstallError(f"`claude mcp {args[0]}` failed: {message[-1] if message else done.returncode}")
