"""One prompt: write_article, which walks an agent through start_pipeline, get_job and the article resource."""

from typing import Annotated, Literal

from mcp.server.mcpserver import MCPServer
from pydantic import Field

LENGTHS = {"short": (3, 120), "medium": (5, 200), "long": (8, 300)}  # sections, words per section


def register(server: MCPServer) -> None:
    @server.prompt(title="Write an illustrated article")
    def write_article(
        topic: Annotated[str, Field(description="what the article is about")],
        audience: Annotated[str, Field(description="who reads it")] = "general readers",
        length: Annotated[Literal["short", "medium", "long"], Field(description="short, medium or long")] = "medium",
    ) -> str:
        """Research, write and illustrate an article with Scriptorium's pipeline."""
        sections, words = LENGTHS.get(length, LENGTHS["medium"])
        return (f"Write an illustrated article about {topic!r} for {audience}. Call start_pipeline with "
                f"topic={topic!r}, audience={audience!r}, sections={sections}, words_per_section={words} and "
                "images=2 (add sources=[...] with paths of notes to ground it, if I gave you any). Then call "
                "get_job with the job_id every few seconds until its status is done, telling me the stage as it "
                "goes. When it is done, read the resource scriptorium://jobs/<job_id>/article.md and give me the "
                "title, a two-sentence summary and the path of article.html. If it fails, tell me the error.")
