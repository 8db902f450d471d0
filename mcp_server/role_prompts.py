"""The roles of a content team, as prompts a user loads into any agent client: research_agent, writing_agent,
image_agent and integration_agent. Each says what the role does on a shared run, with which tools, what to read
in get_run and which call hands the run on."""

from dataclasses import dataclass
from typing import Annotated

from mcp.server.mcpserver import MCPServer
from pydantic import Field

RunArg = Annotated[
    str, Field(description="the shared run's id (from create_run); empty: the role starts one")
]

COMMON = (
    "You are one agent of a team sharing a Scriptorium run; each part of it (the outline, each section, "
    "each image, the article) has a version and a status in get_run. When you edit a part, pass the version "
    "you read as expected_version; if the call is refused because someone changed it since, call get_run "
    "again, redo your change on the new version and try again. Long calls return a job_id: call get_job "
    "until its status is done. A part marked stale was made from an older outline: redo it if it matters."
)


@dataclass(frozen=True)
class Role:
    title: str
    summary: str  # the prompt's description: what the role does, with which tools
    role: str  # as the prompt names it to the agent
    duties: str


RESEARCH = Role(
    "Research agent",
    "Outline an article on a shared run: research, review, set_outline.",
    "research",
    "Call research(run_id) (add instructions=... to steer it, and sources given to create_run ground it). "
    "Read get_run's outline: title, and each section's heading and key_points. Improve it: clear headings, "
    "2 or 3 concrete key points each, then call set_outline(run_id, outline, expected_version=outline.version) "
    'with the whole outline ({"title": ..., "sections": [{"heading": ..., "key_points": [...]}]}). Your part '
    "is done when outline.status is done; hand over to the writing agent with the run_id.",
)
# The roles that join a run someone else started
JOINING = {
    "writing_agent": Role(
        "Writing agent",
        "Write a shared run's sections: write_sections, write_section, set_section.",
        "writing",
        "Wait until get_run's outline.status is done. Call write_sections(run_id) to write every section not "
        "yet written (concurrently). Read each section's text in get_run; for one that is weak, off its key "
        "points or stale, call write_section(run_id, index, instructions='what to change'), or write it "
        "yourself with set_section(run_id, index, text, expected_version=section.version). Keep watching "
        "get_run until outputs.status is done: when the integration agent rejects a section, its status is "
        "rejected and rejected.reason says why; call write_sections(run_id) again (it rewrites the rejected "
        "ones from their reasons) or rewrite it yourself. Your part is done when every section's status is "
        "done; the image and integration agents take it from there.",
    ),
    "image_agent": Role(
        "Image agent",
        "Illustrate a shared run: illustrate, generate_image, set_image.",
        "illustration",
        "Once the outline is done, call illustrate(run_id) to render every image not yet made (ComfyUI; the "
        "LLM lends it the GPU when it must). Read get_run's images: prompt, file and status. To redo one, call "
        "illustrate(run_id, index, prompt='...') with a better prompt (template and checkpoint too, from "
        "list_image_models); to use an image made elsewhere, call set_image(run_id, index, image) with a path "
        "in the allowed directories or a generate_image resource URI. Your part is done when every image's "
        "status is done (skipped says why one could not be made); hand over to the integration agent.",
    ),
    "integration_agent": Role(
        "Integration agent",
        "Review and assemble a shared run: get_run, reject_section, assemble.",
        "integration",
        "When every section and image is done, review them in get_run: does each section cover its heading's "
        "key points, do they read as one article? If a section falls short, call reject_section(run_id, "
        "index, reason, expected_version=section.version) and wait until that section's version grows and its "
        "status is done again (the writing agent rewrites it from your reason). Then call assemble(run_id) "
        "(formats md and html; post_process for web images and a thumbnail). get_run's outputs.status is "
        "done and outputs.markdown and outputs.html are the article's paths when it is finished; an edit "
        "after that makes outputs stale, and assemble again uses the edited parts.",
    ),
}


def brief(role: Role, run_id: str, otherwise: str = "Ask me for the run_id.") -> str:
    """A role's prompt: what the team shares, the role, its run (or how to get one: otherwise), its duties."""
    start = f"The run is {run_id!r}." if run_id else otherwise
    return f"{COMMON}\n\nYour role: {role.role}. {start} {role.duties}"


def _joining_prompt(role: Role):
    def prompt(run_id: RunArg = "") -> str:
        return brief(role, run_id)

    return prompt


def register(server: MCPServer) -> None:
    @server.prompt(title=RESEARCH.title, description=RESEARCH.summary)
    def research_agent(
        run_id: RunArg = "",
        topic: Annotated[str, Field(description="the article's topic, when the role starts the run")] = "",
    ) -> str:
        if topic:
            return brief(
                RESEARCH, run_id, f"Start it with create_run(topic={topic!r}) and tell the team the run_id."
            )
        return brief(
            RESEARCH, run_id, "Ask me for the topic, then start it with create_run and tell me the run_id."
        )

    for name, role in JOINING.items():
        server.prompt(name=name, title=role.title, description=role.summary)(_joining_prompt(role))
