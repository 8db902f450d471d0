"""A stored step is reused only while its files are what it wrote and its inputs are what it read.

The job store records, when a step finishes, the sha256 and size of each file it wrote and the digest of
each step it consumed. A file that is missing, empty or changed, or an input that was redone with a
different result, makes the step stale: it is redone, and so in turn is everything that consumed it.
"""

from pathlib import Path

from common.files import atomic_write_bytes
from common.hashing import fingerprint
from orchestrator.jobs import Step


def file_problem(run_dir: Path, relative: str, recorded: dict | None) -> str | None:
    """What is wrong with one output file, or None; recorded None (an older row): presence only."""
    path = run_dir / relative
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return f"{relative} is missing"
    if not path.is_file():
        return f"{relative} is not a file"
    if size == 0:  # no step writes an empty file: a truncation, not a result
        return f"{relative} is empty"
    if recorded is None:
        return None
    if size != recorded["size"]:
        return f"{relative} has {size} bytes, not the {recorded['size']} it was written with"
    if fingerprint(path.read_bytes())["sha256"] != recorded["sha256"]:
        return f"{relative} changed since it was written"
    return None


def legacy_files(name: str, output) -> list[str]:
    """The files a step recorded before hashes were: named by its output, as the pipeline stored it."""
    if name == "research":
        return ["research.json"]
    if name.startswith("write:") and isinstance(output, str):
        return [output]
    if isinstance(output, dict):
        if name.startswith("illustrate:"):
            return [output["file"]] if output.get("file") else []
        if name == "assemble":
            return [output[k] for k in ("markdown", "html") if output.get(k)]
        if name == "postprocess":
            return [*output.get("web", []), *([output["thumbnail"]] if output.get("thumbnail") else [])]
    return []


def stale_reason(run_dir: Path, step: Step, inputs: dict[str, Step | None]) -> str | None:
    """Why a finished step cannot be reused, or None. inputs: the current rows of the steps it consumes."""
    if step.files is None:
        files = {relative: None for relative in legacy_files(step.name, step.output)}
    else:
        files = step.files
    for relative, recorded in files.items():
        problem = file_problem(run_dir, relative, recorded)
        if problem:
            return problem
    for name, current in inputs.items():
        if current is None or current.status not in ("done", "skipped"):
            return f"its input {name} is not done"
        if step.inputs is not None:
            if step.inputs.get(name) != current.digest:
                return f"its input {name} was redone since"
        elif step.started is not None and current.finished is not None and current.finished > step.started:
            return f"its input {name} was redone since"  # an older row: no digests, so the clock decides
    return None


def keep_previous(run_dir: Path, part: str, step: Step | None, version: int) -> None:
    """Copy the files of a part's current version under history/ before a new version overwrites them."""
    if step is None or step.status != "done" or not step.files or version == 0:
        return
    for relative in step.files:
        source = run_dir / relative
        target = run_dir / "history" / f"{part.replace(':', '-')}.v{version}" / relative
        if source.is_file() and not target.exists():
            atomic_write_bytes(target, source.read_bytes())
