"""The packages depend on each other only downwards (DESIGN.md, "Layout and dependency direction"): common
imports nothing of ours; backend and ops only common (ops meets the services over HTTP, Docker and
processes); orchestrator only common; mcp_server the orchestrator and common, and the job store only
through orchestrator.api. Every import counts, those inside functions too."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("common", "backend", "orchestrator", "mcp_server", "ops")
ALLOWED = {"common": set(), "backend": {"common"}, "orchestrator": {"common"}, "ops": {"common"},
           "mcp_server": {"common", "orchestrator"}}
# What mcp_server may use of the orchestrator: its API, clients, settings and workflow templates, never the store.
MCP_FORBIDDEN = ("orchestrator.jobs", "orchestrator.pipeline")


def imports_of(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module)
            found |= {f"{node.module}.{alias.name}" for alias in node.names}
    return found


def graph() -> dict[str, dict[str, set[str]]]:
    """package -> {module imported from another package: the files importing it}"""
    edges: dict[str, dict[str, set[str]]] = {p: {} for p in PACKAGES}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            for name in imports_of(path):
                top = name.split(".")[0]
                if top in PACKAGES and top != package:
                    edges[package].setdefault(name, set()).add(str(path.relative_to(ROOT)))
    return edges


def test_each_package_imports_only_what_lies_below_it():
    wrong = []
    for package, imported in graph().items():
        for name, files in sorted(imported.items()):
            if name.split(".")[0] not in ALLOWED[package]:
                wrong.append(f"{package} imports {name} ({', '.join(sorted(files))})")
    assert not wrong, "\n".join(wrong)


def test_no_cycles_between_packages():
    edges = {p: {n.split(".")[0] for n in imported} for p, imported in graph().items()}

    def reaches(start: str, goal: str, seen: set[str]) -> bool:
        return any(nxt == goal or (nxt not in seen and reaches(nxt, goal, seen | {nxt})) for nxt in edges[start])

    assert not [p for p in PACKAGES if reaches(p, p, {p})]


def test_mcp_server_reaches_jobs_only_through_the_orchestrator_api():
    used = graph()["mcp_server"]
    wrong = sorted(f"{n} ({', '.join(sorted(f))})" for n, f in used.items() if n.startswith(MCP_FORBIDDEN))
    assert not wrong, "\n".join(wrong)
