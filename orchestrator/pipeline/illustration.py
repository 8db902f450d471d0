"""Illustration: an image prompt per illustrated section from the LLM, the image from ComfyUI."""

import os
from collections.abc import Callable
from contextlib import nullcontext

from common.gpu import probe
from common.sizes import SizeError, in_bytes, parse_memory
from orchestrator import workflows
from orchestrator.clients.comfyui import ComfyUIClient
from orchestrator.clients.completion_budget import fit
from orchestrator.clients.router import LLMRouter
from orchestrator.image_lease import Coordinator
from orchestrator.pipeline.params import ArticleParams
from orchestrator.workflows import edit


async def image_prompt(llm: LLMRouter, outline: dict, index: int, params: ArticleParams) -> str:
    section = outline["sections"][index]
    messages = [
        {"role": "system", "content": "You write prompts for an image generator: one line of concrete visual detail."},
        {"role": "user", "content": (
            f"An illustration for the section \"{section['heading']}\" of the article \"{outline['title']}\" "
            f"({'; '.join(section['key_points'])}). Describe the picture in one sentence: subject, setting, style.")},
    ]
    reply = await llm.chat(messages, max_tokens=await fit(llm, messages, 80), **params.stage_sampling()["image_prompts"].chat(),
                           seed=None if params.seed is None else params.seed + 100 + index)
    prompt = " ".join(reply["text"].split())[:400]
    return prompt or f"an illustration of {section['heading']}"


async def render(comfyui: ComfyUIClient, prompt: str, params: ArticleParams, index: int,
                 on_progress: Callable[[dict], None] | None = None,
                 should_stop: Callable[[], bool] | None = None, extra_data: dict | None = None,
                 template: str | None = None, checkpoint: str | None = None) -> bytes:
    """template/checkpoint: this image's own, instead of the run's template and the template's checkpoint."""
    workflow, defaults = workflows.load(template or params.template)
    seed = None if params.seed is None else params.seed + index
    values = {**defaults, "prompt": prompt, "seed": seed}
    if checkpoint and "checkpoint" in workflows.placeholders(workflow):
        values["checkpoint"] = checkpoint
    filled = workflows.fill(workflow, values)
    if checkpoint and "checkpoint" not in workflows.placeholders(workflow):
        filled = edit.with_checkpoint(filled, checkpoint)
    images = await comfyui.generate(filled, on_progress, should_stop, extra_data)
    return images[0]


# What a render of each built-in template holds on the card (the model loaded plus working memory); a
# user's template is budgeted like the comfyui service: SCRIPTORIUM_COMFYUI_GPU_MEMORY, the value
# compose.yaml's x-ops.gpu_memory for it defaults to.
TEMPLATE_MEMORY = {"sd15": 4 << 30, "sdxl": 8 << 30, "flux": 16 << 30, "img2img": 4 << 30, "upscale": 2 << 30}
DEFAULT_MEMORY = "8GiB"


def image_memory(template: str) -> int:
    if template in TEMPLATE_MEMORY:
        return TEMPLATE_MEMORY[template]
    try:
        amount = parse_memory(os.environ.get("SCRIPTORIUM_COMFYUI_GPU_MEMORY") or DEFAULT_MEMORY)
    except SizeError:
        amount = parse_memory(DEFAULT_MEMORY)
    devices, _ = probe()
    return in_bytes(amount, devices[0].total if devices else 0)


def lease_for(settings, comfyui_url: str | None, llm_url: str | None):
    """The GPU lease coordinator for image jobs (None when there is nothing to coordinate)."""
    if not comfyui_url:
        return None
    return Coordinator(settings, llm_url, comfyui_url)


def holding(lease, template: str, job: str):
    """A context that holds the card for one render (a no-op without a coordinator)."""
    return lease.hold(image_memory(template), job) if lease is not None else nullcontext()
