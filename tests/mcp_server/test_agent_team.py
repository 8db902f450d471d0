"""examples/agent_team.py as a user runs it: four agent processes with their own client names hand one run
from research to assembly over the MCP server's HTTP transport; the integration agent rejects a section and
the writing agent rewrites it."""

import subprocess
import sys
from pathlib import Path

from orchestrator import api
from tests.backend.server_process import ROOT


def test_the_agent_team_example_hands_a_run_from_research_to_assembly(served):
    server, settings, _ = served
    result = subprocess.run(
        [
            sys.executable,
            str(ROOT / "examples" / "agent_team.py"),
            "--url",
            f"{server.url}/mcp",
            "--topic",
            "river ferries",
            "--sections",
            "2",
            "--words",
            "40",
            "--timeout",
            "600",
        ],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=ROOT,
    )
    assert result.returncode == 0, f"{result.stderr}\n--- the MCP server's log:\n{server.log_tail()}"
    article = Path(result.stdout.strip())
    assert article.name == "article.html" and article.is_file()
    run_id = article.parent.name
    state = api.get_run(run_id, settings)
    steps = [(e["client"], e["tool"], e["part"]) for e in state["history"]]
    assert steps[:2] == [
        ("research-agent", "research", "research"),
        ("research-agent", "set_outline", "research"),
    ]
    rejected = next(i for i, s in enumerate(steps) if s[1] == "reject_section")
    index = int(steps[rejected][2].split(":")[1])
    assert steps[rejected][0] == "integration-agent"
    assert ("writing-agent", "write_sections", f"write:{index:02d}") in steps[
        rejected + 1 :
    ]  # rewritten after
    assert steps[-1][0] == "integration-agent" and ("integration-agent", "assemble", "assemble") in steps
    section = state["sections"][index]
    assert section["version"] == 2 and section["status"] == "done"
    md = Path(state["outputs"]["markdown"]).read_text()
    assert md.startswith(f"# {state['outline']['title']}") and section["text"].strip() in md
    assert md.count("](images/") == 2
