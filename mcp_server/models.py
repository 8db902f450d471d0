"""What the tools return: each a pydantic model, so every tool publishes an outputSchema its results meet."""

from typing import Literal

from pydantic import BaseModel, Field


class TextResult(BaseModel):
    text: str
    model: str | None
    tokens: int = Field(description="chunks streamed, about one token each")
    truncated: bool = Field(description="true when the text was cut before the model finished: by max_tokens "
                                        "(finish_reason length) or by the time budget (finish_reason budget)")
    finish_reason: str | None = Field(None, description="stop (the model ended it), length (max_tokens, or the "
                                                        "context, cut it), budget (the time budget ran out)")


class Message(BaseModel):
    role: Literal["system", "user", "assistant"]
    content: str


QUEUE_POSITION = "while it waits for a worker (status queued): its place in the queue, 1 starts next; else null"


class JobStarted(BaseModel):
    job_id: str
    status: str
    message: str
    queue_position: int | None = Field(None, description=QUEUE_POSITION)


class ImageJobResult(BaseModel):
    run_dir: str
    images: list[str] = Field(description="paths of the PNG files")
    seed: int | None = None


class ArticleJobResult(BaseModel):
    run_dir: str
    title: str
    article_md: str | None = Field(description="path of the Markdown article")
    article_html: str | None = Field(description="path of the standalone HTML page")
    images: list[str] = Field(description="paths of the illustrations")
    images_skipped: str | None = Field(None, description="why illustrations are missing, if they are")
    postprocess: dict[str, str | list[str]] = Field(default_factory=dict,
                                                    description="web-sized copies and thumbnail, or why skipped")
    thumbnail: str | None = None
    excerpt: str = ""


class PartChange(BaseModel):
    part: str
    what: str
    version: int


class StageJobResult(BaseModel):
    run_id: str
    stage: str
    changed: list[PartChange] = Field(description="the parts this call made, with their new versions")
    article: ArticleJobResult | None = Field(description="assemble's article")
    summary: str


class JobInfo(BaseModel):
    job_id: str
    kind: Literal["article", "image", "stage"] = Field(description="stage: one stage of a shared run")
    status: str = Field(description="queued (waiting for a worker, or starting) | running | done | failed | "
                                    "cancelled; interrupted = marked running "
                                    "but its worker is gone (`python -m orchestrator resume` continues it); "
                                    "open = a shared run (get_run shows its parts)")
    stage: str | None
    progress: float
    message: str | None
    error: str | None
    queue_position: int | None = Field(None, description=QUEUE_POSITION)
    result: ArticleJobResult | ImageJobResult | StageJobResult | None
    resources: list[str] = Field(description="scriptorium:// URIs of the job and its files")


class JobList(BaseModel):
    jobs: list[JobInfo]
    next_cursor: str | None = Field(description="pass as cursor for the next (older) page; null at the end")


class ImageFile(BaseModel):
    path: str
    uri: str = Field(description="the full image as a resource")
    width: int
    height: int
    bytes: int


class ImageResult(JobInfo):
    images: list[ImageFile] = Field(default_factory=list, description="the finished images (empty while rendering)")


class Upstream(BaseModel):
    url: str
    healthy: bool
    models: list[str]
    error: str | None
    in_flight: int = Field(0, description="this server's requests to it now")
    served: int = Field(0, description="requests it answered for this server")
    last_failure: float | None = Field(None, description="when it last failed (Unix time); null: never")
    ejected_until: float | None = Field(None, description="taken out after failing until then (Unix time), "
                                                          "then probed before it gets traffic again")


class ModelEntry(BaseModel):
    id: str
    upstream: str


class ModelList(BaseModel):
    models: list[ModelEntry]
    upstreams: list[Upstream]


class ComfyStatus(BaseModel):
    url: str | None
    configured: bool
    healthy: bool
    devices: list[dict] = Field(default_factory=list, description="ComfyUI's devices with vram_total/vram_free")
    error: str | None = None


class GPUDevice(BaseModel):
    index: int
    name: str
    total: int
    free: int
    processes: list[dict]
    temperature: int | None = None


class StackStatus(BaseModel):
    llm: list[Upstream]
    comfyui: ComfyStatus
    gpu: list[GPUDevice] | None = Field(description="per-GPU total/free bytes and the processes holding memory; "
                                                    "null when there is no NVIDIA GPU")


class ImageModels(BaseModel):
    checkpoints: list[str]
    loras: list[str]
    vaes: list[str]
    upscalers: list[str]
    templates: list[str] = Field(description="built-in workflow templates (generate_image's template)")


class QueuedPrompt(BaseModel):
    prompt_id: str
    state: Literal["running", "pending"]
    ours: bool = Field(description="submitted by this stack (only ours can be cleared)")


class QueueInfo(BaseModel):
    running: int
    pending: int
    prompts: list[QueuedPrompt]
    cleared: list[str] = Field(default_factory=list, description="prompt ids removed or interrupted by this call")


class Memory(BaseModel):
    vram_total: int
    vram_free: int


class FreedMemory(BaseModel):
    before: list[Memory]
    after: list[Memory]
    freed: int = Field(description="bytes of VRAM freed on all devices together")


class Uploaded(BaseModel):
    name: str = Field(description="the file's name in ComfyUI's input folder (pass as image to img2img/upscale)")
    subfolder: str
    type: str
