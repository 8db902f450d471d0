"""API-format ComfyUI workflow templates with {{placeholders}}.

A JSON string that is exactly "{{name}}" becomes the value itself (a number stays a number);
placeholders inside longer strings are replaced as text. A template may use any subset of
PLACEHOLDERS; a user's own file works the same way.
"""

import json
import random
import re
from importlib import resources
from pathlib import Path

PLACEHOLDERS = ("prompt", "negative_prompt", "width", "height", "steps", "cfg", "seed", "checkpoint", "image", "denoise",
                "upscale_model")
BUILTIN = {
    "sd15": {"width": 512, "height": 512, "steps": 25, "cfg": 7.0, "checkpoint": "v1-5-pruned-emaonly.safetensors",
             "negative_prompt": "blurry, low quality, watermark, text"},
    "sdxl": {"width": 1024, "height": 1024, "steps": 30, "cfg": 7.0, "checkpoint": "sd_xl_base_1.0.safetensors",
             "negative_prompt": "blurry, low quality, watermark, text"},
    "flux": {"width": 1024, "height": 1024, "steps": 20, "cfg": 3.5, "checkpoint": "flux1-dev-fp8.safetensors",
             "negative_prompt": ""},
    # Image input: `image` names a file in ComfyUI's input folder (upload_image puts it there).
    "img2img": {"steps": 25, "cfg": 7.0, "denoise": 0.6, "checkpoint": "v1-5-pruned-emaonly.safetensors",
                "negative_prompt": "blurry, low quality, watermark, text"},
    "upscale": {"upscale_model": "RealESRGAN_x4plus.pth"},
}
NEEDS_IMAGE = ("img2img", "upscale")
_WHOLE = re.compile(r"^\{\{(\w+)\}\}$")
_INLINE = re.compile(r"\{\{(\w+)\}\}")


class TemplateError(Exception):
    pass


def load(template: str) -> tuple[dict, dict]:
    """(workflow, defaults) for a built-in name (sd15, sdxl, flux) or a path to an API-format JSON file."""
    if template in BUILTIN:
        text = resources.files(__package__).joinpath(f"{template}.json").read_text()
        defaults = dict(BUILTIN[template])
        source = f"built-in template {template}"
    else:
        path = Path(template).expanduser()
        if not path.is_file():
            raise TemplateError(f"template {template!r} is neither a built-in ({', '.join(BUILTIN)}) nor a file")
        text, defaults, source = path.read_text(), dict(BUILTIN["sd15"]), str(path)
    try:
        workflow = json.loads(text)
    except json.JSONDecodeError as e:
        raise TemplateError(f"{source}: not valid JSON ({e})") from None
    if not isinstance(workflow, dict) or not all(isinstance(n, dict) and "class_type" in n for n in workflow.values()):
        raise TemplateError(f"{source}: not an API-format workflow (export it with 'Save (API)' in ComfyUI): "
                            "expected an object of nodes, each with class_type and inputs")
    unknown = sorted(set(placeholders(workflow)) - set(PLACEHOLDERS))
    if unknown:
        raise TemplateError(f"{source}: unknown placeholder(s) {', '.join(unknown)}; known: {', '.join(PLACEHOLDERS)}")
    return workflow, defaults


def placeholders(workflow: dict) -> list[str]:
    return sorted(set(_INLINE.findall(json.dumps(workflow))))


def fill(workflow: dict, values: dict) -> dict:
    """A copy of the workflow with every placeholder replaced; a missing value is an error."""
    values = dict(values)
    if values.get("seed") is None:
        values["seed"] = random.randrange(2**48)

    def substitute(node):
        if isinstance(node, dict):
            return {k: substitute(v) for k, v in node.items()}
        if isinstance(node, list):
            return [substitute(v) for v in node]
        if isinstance(node, str):
            whole = _WHOLE.match(node)
            if whole:
                return _value(whole.group(1), values)
            return _INLINE.sub(lambda m: str(_value(m.group(1), values)), node)
        return node

    return substitute(workflow)


def _value(name: str, values: dict):
    if values.get(name) is None:
        if name == "negative_prompt":
            return ""
        raise TemplateError(f"the template needs a value for {{{{{name}}}}}")
    return values[name]
