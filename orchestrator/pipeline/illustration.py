"""Illustration: an image prompt per illustrated section from the LLM, the image from ComfyUI."""

from collections.abc import Callable

from orchestrator import workflows
from orchestrator.clients.comfyui import ComfyUIClient
from orchestrator.clients.llm import LLMRouter
from orchestrator.pipeline.params import ArticleParams


async def image_prompt(llm: LLMRouter, outline: dict, index: int, params: ArticleParams) -> str:
    section = outline["sections"][index]
    reply = await llm.chat([
        {"role": "system", "content": "You write prompts for an image generator: one line of concrete visual detail."},
        {"role": "user", "content": (
            f"An illustration for the section \"{section['heading']}\" of the article \"{outline['title']}\" "
            f"({'; '.join(section['key_points'])}). Describe the picture in one sentence: subject, setting, style.")},
    ], max_tokens=80, temperature=params.temperature, seed=None if params.seed is None else params.seed + 100 + index)
    prompt = " ".join(reply["text"].split())[:400]
    return prompt or f"an illustration of {section['heading']}"


async def render(comfyui: ComfyUIClient, prompt: str, params: ArticleParams, index: int,
                 on_progress: Callable[[dict], None] | None = None,
                 should_stop: Callable[[], bool] | None = None) -> bytes:
    workflow, defaults = workflows.load(params.template)
    seed = None if params.seed is None else params.seed + index
    filled = workflows.fill(workflow, {**defaults, "prompt": prompt, "seed": seed})
    images = await comfyui.generate(filled, on_progress, should_stop)
    return images[0]
