"""ComfyUI's answers, read: its errors as exceptions, a history entry's outcome, a /prompt refusal's node
errors, an input's allowed values as /object_info describes them (orchestrator/clients/comfyui.py asks)."""

from dataclasses import dataclass

import httpx


class ComfyUIError(Exception):
    pass


@dataclass
class NodeError(ComfyUIError):
    """A node that failed validation or execution: its id, its class and ComfyUI's message."""

    node_id: str
    class_type: str
    message: str

    def __str__(self) -> str:
        return f"ComfyUI node {self.node_id} ({self.class_type}): {self.message}"


class Interrupted(ComfyUIError):
    pass


def node_order(node_id: str):
    return (0, int(node_id)) if node_id.isdigit() else (1, node_id)


def choices(spec) -> list | None:
    """The allowed values of an input, as /object_info describes it: [[choices], {...}] (classic), or
    ["COMBO", {"options": [choices], ...}] (newer nodes, model pickers among them); None for other inputs."""
    if not isinstance(spec, (list, tuple)) or not spec:
        return None
    if isinstance(spec[0], list):
        return spec[0]
    if spec[0] == "COMBO" and len(spec) > 1 and isinstance(spec[1], dict):
        return list(spec[1].get("options", []))
    return None


def first_id(workflow: dict, cls: str) -> str:
    return next(node_id for node_id, node in workflow.items() if node["class_type"] == cls)


def finished(entry: dict) -> bool:
    status = entry.get("status") or {}
    return bool(status.get("completed")) or status.get("status_str") in ("success", "error")


def outcome(entry: dict, prompt_id: str) -> dict:
    status = entry.get("status") or {}
    if status.get("status_str") == "error":
        for event, data in status.get("messages", []):
            if event == "execution_error":
                raise NodeError(str(data.get("node_id")), data.get("node_type", "?"),
                                data.get("exception_message", "execution failed").strip())
            if event == "execution_interrupted":
                raise Interrupted(f"ComfyUI prompt {prompt_id} was interrupted")
        raise ComfyUIError(f"ComfyUI prompt {prompt_id} failed")
    return entry


def validation_error(response: httpx.Response) -> ComfyUIError:
    try:
        data = response.json()
    except ValueError:
        return ComfyUIError(f"ComfyUI refused the workflow: {response.text[:300]}")
    problems = list((data.get("node_errors") or {}).items())
    if problems:
        def describe(problem: dict) -> str:
            errors = problem.get("errors") or [{}]
            return "; ".join(f"{e.get('message', '')}: {e.get('details', '')}".strip(": ") for e in errors) or "invalid"

        node_id, first = problems[0]
        message = describe(first)
        for other_id, other in problems[1:]:  # every invalid node, not only the first
            message += f"; also node {other_id} ({other.get('class_type', '?')}): {describe(other)}"
        return NodeError(str(node_id), first.get("class_type", "?"), message)
    error = data.get("error") or {}
    return ComfyUIError(f"ComfyUI refused the workflow: {error.get('message', '')} {error.get('details', '')}".strip())
