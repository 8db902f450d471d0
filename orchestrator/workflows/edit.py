"""Changes to an API-format workflow beyond its placeholders: a LoRA spliced in after the checkpoint, a
checkpoint set on the loader, and named input overrides ("<node>.<input>", node by id, title or class)."""

import copy

from orchestrator.workflows import TemplateError

LOADER = "CheckpointLoaderSimple"


def with_lora(workflow: dict, lora: str, strength: float = 1.0) -> dict:
    """A LoraLoader fed by every checkpoint loader's MODEL and CLIP, and every consumer of those fed by it."""
    out = copy.deepcopy(workflow)
    loaders = [node_id for node_id, node in out.items() if node.get("class_type") == LOADER]
    if not loaders:
        raise TemplateError(f"the workflow has no {LOADER} node to add the LoRA {lora!r} after")
    for n, loader in enumerate(loaders):
        lora_id = f"lora{n}" if f"lora{n}" not in out else f"lora{n}-{len(out)}"
        rewired = {(loader, 0): [lora_id, 0], (loader, 1): [lora_id, 1]}
        for node in out.values():
            for name, value in node.get("inputs", {}).items():
                if isinstance(value, list) and len(value) == 2 and tuple(value) in rewired:
                    node["inputs"][name] = rewired[tuple(value)]
        out[lora_id] = {"class_type": "LoraLoader", "inputs": {
            "model": [loader, 0], "clip": [loader, 1], "lora_name": lora, "strength_model": strength,
            "strength_clip": strength}}
    return out


def with_checkpoint(workflow: dict, checkpoint: str) -> dict:
    out = copy.deepcopy(workflow)
    for node in out.values():
        if node.get("class_type") == LOADER:
            node.setdefault("inputs", {})["ckpt_name"] = checkpoint
    return out


def find_node(workflow: dict, ref: str) -> str:
    """The id of the one node `ref` names: its id, its _meta.title, or its class_type."""
    if ref in workflow:
        return ref
    for key in (lambda n: (n.get("_meta") or {}).get("title"), lambda n: n.get("class_type")):
        matches = [node_id for node_id, node in workflow.items() if key(node) == ref]
        if len(matches) == 1:
            return matches[0]
        if len(matches) > 1:
            raise TemplateError(f"{ref!r} names {len(matches)} nodes ({', '.join(matches)}); use a node id")
    known = ", ".join(f"{i} ({n.get('class_type')})" for i, n in workflow.items())
    raise TemplateError(f"the workflow has no node {ref!r}; its nodes: {known}")


def with_inputs(workflow: dict, overrides: dict) -> dict:
    """overrides: {"<node>.<input>": value}; the input must be one the node has (a link stays a link)."""
    out = copy.deepcopy(workflow)
    for key, value in overrides.items():
        ref, _, name = key.rpartition(".")
        if not ref or not name:
            raise TemplateError(f"override {key!r} is neither a placeholder nor <node>.<input> (e.g. KSampler.seed)")
        node_id = find_node(out, ref)
        inputs = out[node_id].setdefault("inputs", {})
        if name not in inputs:
            raise TemplateError(f"node {node_id} ({out[node_id].get('class_type')}) has no input {name!r}; it has "
                                f"{', '.join(inputs) or 'none'}")
        if isinstance(inputs[name], list) and len(inputs[name]) == 2 and not isinstance(value, list):
            raise TemplateError(f"{key} is a link to node {inputs[name][0]}, not a value to override")
        inputs[name] = value
    return out
