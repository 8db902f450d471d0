"""Who the server is, and its answer to `initialize`, without the SDK: the stdio front answers a client's
`initialize` from here at once (agents time their servers' start-up), while the SDK, which takes seconds to
import on a loaded machine, loads behind it. build_server gives the SDK server the same name, instructions and
version, and tests/mcp_server/test_stdio_first_start.py checks that the SDK answers exactly this."""

from importlib.metadata import PackageNotFoundError, metadata, version

from mcp_server import toolsets

NAME, TITLE = "scriptorium", "Scriptorium"
# The versions the SDK negotiates through `initialize` (mcp_types.version.HANDSHAKE_PROTOCOL_VERSIONS), oldest
# first; importing its table costs 0.2 s of pydantic.
HANDSHAKE_VERSIONS = ("2024-11-05", "2025-03-26", "2025-06-18", "2025-11-25")
# What build_server's registrations offer; the lists can change (the front may answer them from an earlier start,
# and sends list_changed when the SDK server's own differ).
CAPABILITIES = {
    "logging": {},
    "prompts": {"listChanged": True},
    "resources": {"listChanged": False, "subscribe": True},
    "tools": {"listChanged": True},
}

INSTRUCTIONS = """Scriptorium: a local AI stack. Generate text with generate_text/chat, images with generate_image,
and whole illustrated articles with start_pipeline (then poll get_job). Long calls return a job_id within about 45
seconds: call get_job(job_id) until its status is done. Images come back as resource links with small thumbnails;
articles and images of finished jobs are resources (scriptorium://jobs/{job_id}/article.md, .../images/{name}).
File arguments must lie in your roots or the directories in SCRIPTORIUM_MCP_ALLOWED_DIRS."""
TEAM_INSTRUCTIONS = """For a team of agents, create_run makes a shared run: research, set_outline, write_sections,
write_section, set_section, illustrate, set_image and assemble each do or edit one part, and get_run shows every
part with its version (the prompts research_agent, writing_agent, image_agent and integration_agent explain each
role)."""


def instructions(names: tuple[str, ...]) -> str:
    """The instructions for a server listing the toolsets `names`."""
    return INSTRUCTIONS + ("\n" + TEAM_INSTRUCTIONS if "create_run" in toolsets.chosen(names) else "")


def server_version() -> str:
    try:
        return version("scriptorium")
    except PackageNotFoundError:
        return "0.0.0+source"


def website() -> str | None:
    """The project's home page from its package metadata ([project.urls] Homepage), if it names one."""
    try:
        meta = metadata("scriptorium")
    except PackageNotFoundError:
        return None
    for entry in meta.get_all("Project-URL") or []:
        label, _, url = entry.partition(",")
        if label.strip().lower() in ("homepage", "home", "documentation", "source"):
            return url.strip()
    return meta.get("Home-page") or None


def negotiated(requested: str) -> str:
    """The spec's rule: the client's version when the server speaks it, else the latest the server speaks."""
    return requested if requested in HANDSHAKE_VERSIONS else HANDSHAKE_VERSIONS[-1]


def result(params: object, names: tuple[str, ...]) -> dict | None:
    """The result for an `initialize` with these params, or None when the SDK would refuse them (then the SDK
    answers, with its error)."""
    if (
        not isinstance(params, dict)
        or not isinstance(params.get("protocolVersion"), str)
        or not isinstance(params.get("capabilities"), dict)
    ):
        return None
    client = params.get("clientInfo")
    if (
        not isinstance(client, dict)
        or not isinstance(client.get("name"), str)
        or not isinstance(client.get("version"), str)
    ):
        return None
    info = {"name": NAME, "title": TITLE, "version": server_version()}
    if url := website():
        info["websiteUrl"] = url
    return {
        "capabilities": CAPABILITIES,
        "instructions": instructions(names),
        "protocolVersion": negotiated(params["protocolVersion"]),
        "serverInfo": info,
    }
