"""An image job: one ComfyUI render from a template, stored like any run (the MCP image tool's job)."""

import os
from dataclasses import asdict, dataclass

from common.files import atomic_write_bytes
from orchestrator import workflows
from orchestrator.clients.comfyui import ComfyUIClient, Interrupted
from orchestrator.jobs import JobStore
from orchestrator.pipeline.illustration import holding, lease_for
from orchestrator.pipeline.outputs import fingerprint
from orchestrator.pipeline.params import ParamsError
from orchestrator.settings import Settings


@dataclass
class ImageParams:
    prompt: str
    negative_prompt: str | None = None
    width: int | None = None  # None: the template's default
    height: int | None = None
    steps: int | None = None
    cfg: float | None = None
    seed: int | None = None
    template: str = "sd15"
    comfyui_url: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.prompt, str) or not self.prompt.strip():
            raise ParamsError("prompt must be a non-empty string")
        for name in ("width", "height"):
            value = getattr(self, name)
            if value is not None and not (64 <= value <= 4096 and value % 8 == 0):
                raise ParamsError(f"{name} must be a multiple of 8 between 64 and 4096, got {value}")
        if self.steps is not None and not 1 <= self.steps <= 200:
            raise ParamsError(f"steps must be between 1 and 200, got {self.steps}")

    @classmethod
    def from_dict(cls, data: dict) -> "ImageParams":
        unknown = sorted(set(data) - set(cls.__dataclass_fields__))
        if unknown:
            raise ParamsError(f"unknown image setting(s): {', '.join(unknown)}")
        return cls(**data)

    def to_dict(self) -> dict:
        return asdict(self)


async def run_image(store: JobStore, run_id: str, settings: Settings) -> dict:
    store.claim(run_id, os.getpid())
    params = ImageParams.from_dict(store.get(run_id).params)
    url = params.comfyui_url or settings.comfyui_url
    run_dir = settings.runs_dir / run_id
    try:
        if not url:
            raise ParamsError("ComfyUI is not configured: set SCRIPTORIUM_COMFYUI_URL (or start the stack's comfyui "
                              "service with `ops up`)")
        workflow, defaults = workflows.load(params.template)
        values = {**defaults, **{k: v for k, v in params.to_dict().items() if v is not None}}
        filled = workflows.fill(workflow, values)
        store.start_step(run_id, "render")
        store.update(run_id, stage="render")

        def progress(event: dict) -> None:
            if event.get("max"):
                store.update(run_id, progress=min(event["value"] / event["max"], 0.99),
                             message=f"step {event['value']}/{event['max']}")

        lease = lease_for(settings, url, settings.llm_urls[0])
        try:
            async with holding(lease, params.template, run_id), ComfyUIClient(url, settings.comfyui_timeout) as comfy:
                images = await comfy.generate(filled, progress, lambda: store.cancel_requested(run_id))
        finally:
            if lease is not None:
                await lease.finish()
        run_dir.mkdir(parents=True, exist_ok=True)
        paths, files = [], {}
        for i, data in enumerate(images):
            path = run_dir / f"image-{i:02d}.png"
            atomic_write_bytes(path, data)
            paths.append(str(path))
            files[path.name] = fingerprint(data)
        result = {"run_dir": str(run_dir), "images": paths, "seed": values.get("seed")}
        store.finish_step(run_id, "render", result, files=files)
    except Interrupted:
        store.update(run_id, status="cancelled", message="cancelled; the ComfyUI prompt was interrupted")
        raise
    except BaseException as e:
        if store.step(run_id, "render") is not None:
            store.fail_step(run_id, "render", str(e))
        store.update(run_id, status="failed", error=str(e) or type(e).__name__)
        raise
    store.update(run_id, status="done", progress=1.0, result=result, message="done")
    return result
