"""What the shared-run tools return (get_run's state, a stage's outcome, an edit's new version): pydantic models,
so each tool publishes an outputSchema its results meet."""

from typing import Any

from pydantic import BaseModel, Field

from mcp_server.models import StageJobResult


class ChangedBy(BaseModel):
    client: str = Field(description="the MCP client's name (or cli, pipeline)")
    tool: str
    at: float = Field(description="Unix time")


class PartState(BaseModel):
    status: str = Field(
        description="missing | running | done | failed | rejected (a section sent back) | stale (its inputs changed since it was "
        "made: re-running it is your choice) | skipped (an image that could not be made)"
    )
    version: int = Field(description="pass as expected_version when you edit this part; 0 = never made")
    stale_reason: str | None
    outline_version: int | None = Field(description="the outline version this part was made from")
    error: str | None
    changed_by: ChangedBy | None


class OutlineSection(BaseModel):
    heading: str
    key_points: list[str]


class OutlineState(PartState):
    title: str | None
    sections: list[OutlineSection]
    sources: list[str] = Field(description="names of the source files the research read")


class Rejection(BaseModel):
    reason: str
    client: str
    at: float


class SectionState(PartState):
    index: int
    heading: str | None
    text: str | None
    words: int
    rejected: Rejection | None = Field(
        description="why the text as it stands was sent back (status rejected); "
        "write_section or write_sections rewrites it from the reason"
    )


class ImageState(PartState):
    index: int = Field(description="the section it illustrates")
    prompt: str | None
    file: str | None = Field(description="path of the PNG")
    skipped: str | None = Field(description="why it could not be made, if it could not")


class OutputsState(PartState):
    markdown: str | None = Field(description="path of article.md")
    html: str | None = Field(description="path of article.html")
    postprocess: dict[str, Any] | None


class HistoryEntry(BaseModel):
    part: str = Field(description="research (the outline), write:NN, illustrate:NN, assemble, postprocess")
    what: str
    version: int
    client: str
    tool: str
    at: float
    digest: str
    note: str | None = Field(description="the instructions or prompt it was made with")


class RunState(BaseModel):
    run_id: str
    status: str = Field(description="open: a shared run its stages are done on one at a time")
    topic: str
    audience: str
    params: dict[str, Any]
    outline: OutlineState
    sections: list[SectionState]
    images: list[ImageState]
    outputs: OutputsState
    history: list[HistoryEntry] = Field(description="every change, oldest first")


class RunCreated(BaseModel):
    run_id: str
    sections: int
    images: int
    message: str


class PartSet(BaseModel):
    run_id: str
    part: str
    version: int = Field(description="the part's new version")
    message: str


class StageOutcome(BaseModel):
    job_id: str = Field(description="the stage's job: get_job(job_id) while it runs")
    run_id: str
    stage: str
    status: str
    progress: float
    message: str | None
    error: str | None
    result: StageJobResult | None
