"""Toolsets: which tools the server lists. Every tool's name, description and schema sits in the agent's
context on every turn, so an agent starts with `core` and adds the sets its work needs."""

CORE = ("generate_text", "chat", "list_models", "generate_image", "start_pipeline", "get_job", "cancel_job",
        "list_jobs", "stack_status")
# Stages of a shared run return a job_id when they outlast the budget, so team and images can follow jobs.
TEAM = ("create_run", "get_run", "research", "set_outline", "write_sections", "write_section", "set_section",
        "reject_section", "illustrate", "set_image", "assemble", "get_job", "cancel_job")
IMAGES = ("generate_image", "run_workflow", "upload_image", "list_image_models", "comfyui_queue", "free_image_memory",
          "get_job", "cancel_job")
TOOLSETS: dict[str, tuple[str, ...]] = {"core": CORE, "team": TEAM, "images": IMAGES}
ALL = frozenset(tool for tools in TOOLSETS.values() for tool in tools)  # every tool the server has
NAMES = (*TOOLSETS, "all")


class ToolsetError(ValueError):
    pass


def chosen(names: tuple[str, ...] | list[str]) -> frozenset[str]:
    """The tools the named toolsets list together."""
    unknown = [n for n in names if n not in NAMES]
    if unknown:
        raise ToolsetError(f"unknown toolset {', '.join(repr(n) for n in unknown)} (SCRIPTORIUM_MCP_TOOLSETS or "
                           f"--toolsets); valid toolsets: {', '.join(NAMES)}")
    if not names:
        raise ToolsetError(f"no toolset chosen; valid toolsets: {', '.join(NAMES)}")
    if "all" in names:
        return ALL
    return frozenset(tool for n in names for tool in TOOLSETS[n])


def parse(value: str) -> tuple[str, ...]:
    """`core,team` as names, checked."""
    names = tuple(n.strip() for n in value.split(",") if n.strip())
    chosen(names)
    return names


def not_listed(tool: str, names: tuple[str, ...]) -> str:
    """What a client that calls a tool outside the chosen toolsets is told."""
    sets = [n for n, tools in TOOLSETS.items() if tool in tools]
    return (f"{tool} is in the {' or '.join(sets)} toolset, which this server does not list (it lists "
            f"{','.join(names)}); restart it with --toolsets {','.join((*names, sets[0]))} or set "
            f"SCRIPTORIUM_MCP_TOOLSETS")
