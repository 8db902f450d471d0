"""An image job: one ComfyUI render from a template, stored like any run (the MCP image tool's job)."""

import os
import random
from dataclasses import asdict, dataclass, field

from common.files import atomic_write_bytes
from common.settings import Settings
from orchestrator import workflows
from orchestrator.cancelling import Cancelled, unless_cancelled
from orchestrator.clients.comfyui import ComfyUIClient, Interrupted
from orchestrator.jobs import JobStore
from orchestrator.pipeline.illustration import holding, lease_for
from orchestrator.pipeline.params import ParamsError, from_fields
from orchestrator.pipeline.step_reuse import fingerprint
from orchestrator.workflows import edit


@dataclass
class ImageParams:
    prompt: str | None = None  # needed by the templates that have {{prompt}}
    negative_prompt: str | None = None
    width: int | None = None  # None: the template's default
    height: int | None = None
    steps: int | None = None
    cfg: float | None = None
    seed: int | None = None
    template: str = "sd15"  # a built-in name or the path of an API-format workflow
    comfyui_url: str | None = None
    checkpoint: str | None = None  # a file from list_image_models' checkpoints
    lora: str | None = None  # spliced in after the checkpoint loader
    lora_strength: float = 1.0
    image: str | None = None  # a file in ComfyUI's input folder (img2img, upscale)
    denoise: float | None = None
    upscale_model: str | None = None
    overrides: dict = field(default_factory=dict)  # {"placeholder": v} or {"<node>.<input>": v}

    def __post_init__(self) -> None:
        if self.prompt is not None and (not isinstance(self.prompt, str) or not self.prompt.strip()):
            raise ParamsError("prompt must be a non-empty string")
        for name in ("width", "height"):
            value = getattr(self, name)
            if value is not None and not (64 <= value <= 4096 and value % 8 == 0):
                raise ParamsError(f"{name} must be a multiple of 8 between 64 and 4096, got {value}")
        if self.steps is not None and not 1 <= self.steps <= 200:
            raise ParamsError(f"steps must be between 1 and 200, got {self.steps}")
        if self.denoise is not None and not 0 < self.denoise <= 1:
            raise ParamsError(f"denoise must be in (0, 1], got {self.denoise}")
        if not isinstance(self.overrides, dict):
            raise ParamsError("overrides must be an object of names to values")
        if self.template in workflows.NEEDS_IMAGE and not self.image:
            raise ParamsError(f"the {self.template} template needs an image (upload one with upload_image)")

    @classmethod
    def from_dict(cls, data: dict) -> "ImageParams":
        return from_fields(cls, data, "image")

    def to_dict(self) -> dict:
        return asdict(self)


def build_workflow(params: ImageParams) -> tuple[dict, dict]:
    """(the workflow to submit, the placeholder values used): template filled, then checkpoint, LoRA and named
    input overrides applied. Raises TemplateError naming what is wrong."""
    workflow, defaults = workflows.load(params.template)
    named = {k: v for k, v in params.overrides.items() if "." not in k}
    unknown = sorted(set(named) - set(workflows.PLACEHOLDERS))
    if unknown:
        raise workflows.TemplateError(f"unknown override(s) {', '.join(unknown)}: use a placeholder "
                                      f"({', '.join(workflows.PLACEHOLDERS)}) or <node>.<input>")
    given = {k: v for k, v in params.to_dict().items() if k in workflows.PLACEHOLDERS and v is not None}
    values = {**defaults, **given, **named}
    if values.get("seed") is None:  # chosen here, so the result can say which seed made the image
        values["seed"] = random.randrange(2**48)
    filled = workflows.fill(workflow, values)
    if params.checkpoint and "checkpoint" not in workflows.placeholders(workflow):
        filled = edit.with_checkpoint(filled, params.checkpoint)
    if params.lora:
        filled = edit.with_lora(filled, params.lora, params.lora_strength)
    filled = edit.with_inputs(filled, {k: v for k, v in params.overrides.items() if "." in k})
    return filled, values


async def run_image(store: JobStore, run_id: str, settings: Settings) -> dict:
    store.claim(run_id, os.getpid())
    params = ImageParams.from_dict(store.get(run_id).params)
    url = params.comfyui_url or settings.comfyui_url
    run_dir = settings.runs_dir / run_id
    try:
        if not url:
            raise ParamsError("ComfyUI is not configured: set SCRIPTORIUM_COMFYUI_URL (or start the stack's comfyui "
                              "service with `ops up`)")
        filled, values = build_workflow(params)
        store.start_step(run_id, "render")
        store.update(run_id, stage="render")

        def progress(event: dict) -> None:
            if event.get("max"):
                store.update(run_id, progress=min(event["value"] / event["max"], 0.99),
                             message=f"step {event['value']}/{event['max']}")

        lease = lease_for(settings, url, settings.llm_urls[0])
        try:
            async with holding(lease, params.template, run_id), ComfyUIClient(url, settings.comfyui_timeout) as comfy:
                images = await unless_cancelled(store, run_id, comfy.generate(
                    filled, progress, lambda: store.cancel_requested(run_id), {"scriptorium_job": run_id}))
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
    except (Interrupted, Cancelled):
        store.update(run_id, status="cancelled", message="cancelled; the ComfyUI prompt was interrupted")
        raise
    except BaseException as e:
        if store.step(run_id, "render") is not None:
            store.fail_step(run_id, "render", str(e))
        store.update(run_id, status="failed", error=str(e) or type(e).__name__)
        raise
    store.update(run_id, status="done", progress=1.0, result=result, message="done")
    return result
