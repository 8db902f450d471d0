"""The ComfyUI stand-in's node catalogue (tests/orchestrator/fake_comfyui.py): each node class's inputs and
outputs as /object_info lists them, a prompt checked as ComfyUI checks it at submission, the order its nodes run
in, and the PNG files SaveImage writes."""

import io
from pathlib import Path

UPSCALERS = ["RealESRGAN_x4plus.pth"]
CHECKPOINTS = ["v1-5-pruned-emaonly.safetensors", "sd_xl_base_1.0.safetensors", "flux1-dev-fp8.safetensors"]
LORAS = ["ink-wash.safetensors", "illuminated-manuscript.safetensors"]
VAES = ["vae-ft-mse-840000-ema-pruned.safetensors"]
VRAM_TOTAL, VRAM_LOADED = 24 << 30, 3 << 30  # a loaded checkpoint holds 3 GiB until /free
INT, FLOAT, STRING = ["INT", {"default": 0}], ["FLOAT", {"default": 0.0}], ["STRING", {"default": ""}]
NODES = {
    "CheckpointLoaderSimple": ({"ckpt_name": [CHECKPOINTS]}, ["MODEL", "CLIP", "VAE"]),
    "EmptyLatentImage": ({"width": INT, "height": INT, "batch_size": INT}, ["LATENT"]),
    "EmptySD3LatentImage": ({"width": INT, "height": INT, "batch_size": INT}, ["LATENT"]),
    "LoraLoader": ({"model": ["MODEL"], "clip": ["CLIP"], "lora_name": [LORAS], "strength_model": FLOAT,
                    "strength_clip": FLOAT}, ["MODEL", "CLIP"]),
    "VAELoader": ({"vae_name": [VAES]}, ["VAE"]),
    "LoadImage": ({"image": [[], {"image_upload": True}]}, ["IMAGE", "MASK"]),  # choices: the input folder
    "VAEEncode": ({"pixels": ["IMAGE"], "vae": ["VAE"]}, ["LATENT"]),
    "CLIPTextEncode": ({"text": STRING, "clip": ["CLIP"]}, ["CONDITIONING"]),
    "ConditioningZeroOut": ({"conditioning": ["CONDITIONING"]}, ["CONDITIONING"]),
    "FluxGuidance": ({"conditioning": ["CONDITIONING"], "guidance": FLOAT}, ["CONDITIONING"]),
    "KSampler": ({"model": ["MODEL"], "seed": INT, "steps": INT, "cfg": FLOAT,
                  "sampler_name": [["euler", "euler_ancestral", "dpmpp_2m"]],
                  "scheduler": [["normal", "karras", "simple"]], "positive": ["CONDITIONING"],
                  "negative": ["CONDITIONING"], "latent_image": ["LATENT"], "denoise": FLOAT}, ["LATENT"]),
    "VAEDecode": ({"samples": ["LATENT"], "vae": ["VAE"]}, ["IMAGE"]),
    "SaveImage": ({"images": ["IMAGE"], "filename_prefix": STRING}, []),
    # Newer nodes describe choices as ["COMBO", {"options": [...]}]; ComfyUI leaves them to run time.
    "UpscaleModelLoader": ({"model_name": ["COMBO", {"multiselect": False, "options": UPSCALERS}]},
                           ["UPSCALE_MODEL"]),
    "ImageUpscaleWithModel": ({"upscale_model": ["UPSCALE_MODEL"], "image": ["IMAGE"]}, ["IMAGE"]),
}


def spec(cls: str, input_dir: Path) -> tuple[dict, list]:
    inputs, outputs = NODES[cls]
    if cls == "LoadImage":  # like ComfyUI, the files in the input folder at the time of asking
        files = sorted(p.name for p in input_dir.iterdir() if p.is_file()) if input_dir.is_dir() else []
        inputs = {"image": [files, {"image_upload": True}]}
    return inputs, outputs


def object_info(cls: str, input_dir: Path) -> dict:
    inputs, outputs = spec(cls, input_dir)
    return {"input": {"required": inputs}, "output": outputs, "output_node": cls == "SaveImage", "name": cls,
            "display_name": cls, "category": "test"}


def node_error(kind: str, message: str, details: str) -> dict:
    return {"type": kind, "message": message, "details": details, "extra_info": {}}


def validate(prompt: dict, input_dir: Path) -> tuple[dict | None, dict]:
    """(top-level error or None, node_errors) the way ComfyUI's validate_prompt reports them."""
    if not isinstance(prompt, dict):
        return node_error("invalid_prompt", "Invalid prompt", "not an object"), {}
    for node_id, node in prompt.items():
        if not isinstance(node, dict) or node.get("class_type") not in NODES:
            cls = node.get("class_type") if isinstance(node, dict) else None
            return node_error("invalid_prompt", f"Cannot execute because node {cls} does not exist.",
                              f"Node ID '#{node_id}'"), {}
    if not any(node["class_type"] == "SaveImage" for node in prompt.values()):
        return node_error("prompt_no_outputs", "Prompt has no outputs", ""), {}
    errors = {}
    for node_id, node in prompt.items():
        inputs, _ = spec(node["class_type"], input_dir)
        problems = []
        for name, kind in inputs.items():
            value = node.get("inputs", {}).get(name)
            if value is None:
                problems.append(node_error("required_input_missing", "Required input is missing", name))
            elif isinstance(value, list) and len(value) == 2 and isinstance(value[0], str):
                source = prompt.get(value[0])
                outputs = NODES[source["class_type"]][1] if source else []
                if source is None or not isinstance(value[1], int) or value[1] >= len(outputs):
                    problems.append(node_error("bad_linked_input", "Bad linked input", f"{name}: {value}"))
                elif outputs[value[1]] != kind[0]:
                    problems.append(node_error("return_type_mismatch", "Return type mismatch between linked nodes",
                                               f"{name}, received_type({outputs[value[1]]}) mismatch "
                                               f"input_type({kind[0]})"))
            elif kind[0] == "COMBO":
                pass  # checked when the node runs
            elif isinstance(kind[0], list) and value not in kind[0]:
                problems.append(node_error("value_not_in_list", "Value not in list",
                                           f"{name}: '{value}' not in {kind[0]}"))
            elif kind[0] in ("INT", "FLOAT") and not isinstance(value, (int, float)):
                problems.append(node_error("invalid_input_type", f"Failed to convert an input value to a {kind[0]} "
                                           "value", f"{name}, {value}"))
        if problems:
            errors[node_id] = {"errors": problems, "dependent_outputs": [], "class_type": node["class_type"]}
    if errors:
        return node_error("prompt_outputs_failed_validation", "Prompt outputs failed validation", ""), errors
    return None, {}


def order(prompt: dict) -> list[str]:
    done, result = set(), []

    def visit(node_id: str) -> None:
        if node_id in done:
            return
        done.add(node_id)
        for value in prompt[node_id].get("inputs", {}).values():
            if isinstance(value, list) and len(value) == 2 and value[0] in prompt:
                visit(value[0])
        result.append(node_id)

    for node_id in prompt:
        visit(node_id)
    return result


def size_of(prompt: dict, node_id: str, input_dir: Path) -> tuple[int, int]:
    """The pixel size flowing out of a node: from the empty latent, or the loaded image (x4 through an upscaler)."""
    from PIL import Image

    node = prompt[node_id]
    cls, inputs = node["class_type"], node["inputs"]
    if cls.startswith("Empty"):
        return int(inputs["width"]), int(inputs["height"])
    if cls == "LoadImage":
        with Image.open(input_dir / inputs["image"]) as image:
            return image.size
    source = {"VAEEncode": "pixels", "KSampler": "latent_image", "VAEDecode": "samples", "SaveImage": "images",
              "ImageUpscaleWithModel": "image"}[cls]
    width, height = size_of(prompt, inputs[source][0], input_dir)
    return (width * 4, height * 4) if cls == "ImageUpscaleWithModel" else (width, height)


def png(width: int, height: int, seed: int) -> bytes:
    from PIL import Image

    color = (seed * 97 % 256, seed * 57 % 256, seed * 31 % 256)
    buffer = io.BytesIO()
    Image.new("RGB", (width, height), color).save(buffer, format="PNG")
    return buffer.getvalue()
