"""A stand-in for ComfyUI (which cannot be installed from package registries) that speaks its protocol.

HTTP: POST /prompt (validated like ComfyUI: node types, required inputs, links and their types,
classic choice lists; 400 with node_errors; extra_data and client_id kept in the queue entry),
GET /history[/{id}], GET /view, GET /object_info[/{class}] (LoadImage's choices are the files in the
input folder, with image_upload), POST /upload/image (multipart "image", "overwrite", "type",
"subfolder"; an existing name without overwrite becomes "name (1).ext"), GET /system_stats (VRAM free
drops while a model is loaded), POST /free, POST /interrupt (of one prompt_id, or of whatever runs),
GET/POST /queue (delete pending prompts, clear). Websocket /ws?clientId=: status, execution_start, execution_cached,
executing, progress, executed, execution_error, execution_interrupted, execution_success.

Behaviours checked against ComfyUI 0.3.64 run on the CPU: one worker runs prompts in order; a prompt's
history appears only after execution_success (written by the worker afterwards), then `executing`
with node null ends it; a prompt identical to one already run is answered from the cache
(execution_cached lists its nodes, no executing events, executed sent again with the same files);
"COMBO"-style inputs (newer nodes) are not checked at submission, a missing choice fails at run time.
SaveImage writes real PNG files. Tests steer it through /_test/behaviour (fail a node class, or hang
in KSampler until interrupted) and read what it saw at /_test/calls.

Run: python -m tests.orchestrator.fake_comfyui --port P --output DIR
"""

import argparse
import asyncio
import contextlib
import json
import time
import uuid
from pathlib import Path

from fastapi import FastAPI, Request, WebSocket, WebSocketDisconnect
from fastapi.responses import JSONResponse, Response

from tests.orchestrator.fake_comfyui_graph import (
    NODES,
    VRAM_LOADED,
    VRAM_TOTAL,
    object_info,
    order,
    png,
    size_of,
    spec,
    validate,
)


def build_app(output_dir: Path, input_dir: Path) -> FastAPI:
    app = FastAPI()
    state = {"behaviour": {}, "history": {}, "sockets": {}, "calls": [], "interrupt": asyncio.Event(), "counter": 0,
             "loaded": False, "pending": [], "running": None, "worker": None, "cache": {}}

    async def send(client_id: str | None, kind: str, data: dict) -> None:
        targets = [state["sockets"][client_id]] if client_id in state["sockets"] else list(state["sockets"].values())
        for ws in targets:
            with contextlib.suppress(Exception):  # a client that went away
                await ws.send_json({"type": kind, "data": data})

    async def execute(prompt_id: str, prompt: dict, client_id: str | None) -> str:
        """Runs one prompt; returns its status_str. Its history is written by the worker afterwards."""
        entry = state["history"][prompt_id]
        messages = entry["status"]["messages"]
        behaviour = state["behaviour"]
        state["interrupt"].clear()

        async def event(kind: str, data: dict, record: bool = False) -> None:
            data = {**data, "prompt_id": prompt_id}
            if record:
                messages.append([kind, {**data, "timestamp": int(time.time() * 1000)}])
            await send(client_id, kind, data)

        await event("execution_start", {}, record=True)
        key = json.dumps(prompt, sort_keys=True)
        cached = state["cache"].get(key)
        await event("execution_cached", {"nodes": list(prompt) if cached else []}, record=True)
        if cached:  # every node's outputs are known: no executing events, the outputs sent again
            for node_id, output in cached.items():
                entry["outputs"][node_id] = output
                await event("executed", {"node": node_id, "display_node": node_id, "output": output})
            await event("execution_success", {}, record=True)
            return "success"
        state["loaded"] = True  # a checkpoint stays loaded until /free
        executed = []
        for node_id in order(prompt):
            node = prompt[node_id]
            cls = node["class_type"]
            await event("executing", {"node": node_id, "display_node": node_id})
            inputs, _ = spec(cls, input_dir)
            missing = [name for name, kind in inputs.items() if kind[0] == "COMBO"
                       and node["inputs"].get(name) not in kind[1]["options"]]
            if behaviour.get("fail_class") == cls or missing:
                message = behaviour.get("message", "out of memory") if not missing else \
                    f"[Errno 2] No such file or directory: '{node['inputs'][missing[0]]}'\n"
                await event("execution_error", {"node_id": node_id, "node_type": cls, "executed": executed,
                                                "exception_message": message,
                                                "exception_type": "torch.OutOfMemoryError", "traceback": [],
                                                "current_inputs": {}, "current_outputs": {}}, record=True)
                return "error"
            if cls == "KSampler":
                steps = int(node["inputs"]["steps"])
                for step in range(1, steps + 1):
                    while state["behaviour"].get("hang") and not state["interrupt"].is_set():  # read live
                        await asyncio.sleep(0.05)
                    if state["interrupt"].is_set():
                        await event("execution_interrupted", {"node_id": node_id, "node_type": cls,
                                                              "executed": executed}, record=True)
                        return "error"
                    await event("progress", {"value": step, "max": steps, "node": node_id})
                    await asyncio.sleep(0.005)
            if cls == "SaveImage":
                sampler = next((n for n in prompt.values() if n["class_type"] == "KSampler"), None)
                state["counter"] += 1
                name = f"{node['inputs']['filename_prefix']}_{state['counter']:05d}_.png"
                width, height = size_of(prompt, node_id, input_dir)
                (output_dir / name).write_bytes(png(width, height, int(sampler["inputs"]["seed"]) if sampler else 0))
                output = {"images": [{"filename": name, "subfolder": "", "type": "output"}]}
                entry["outputs"][node_id] = output
                await event("executed", {"node": node_id, "display_node": node_id, "output": output})
            executed.append(node_id)
        state["cache"][key] = dict(entry["outputs"])
        await event("execution_success", {}, record=True)
        return "success"

    async def worker() -> None:
        """ComfyUI's single prompt worker: one prompt at a time, in order."""
        while state["pending"]:
            prompt_id, prompt, client_id = state["pending"].pop(0)
            state["running"] = prompt_id
            status = await execute(prompt_id, prompt, client_id)
            await asyncio.sleep(0.1)  # ComfyUI writes the history after execution_success, a moment later
            state["history"][prompt_id]["status"].update(status_str=status, completed=status == "success")
            state["running"] = None
            await send(client_id, "executing", {"node": None, "prompt_id": prompt_id})

    @app.post("/prompt")
    async def post_prompt(request: Request):
        body = await request.json()
        prompt = body.get("prompt")
        error, node_errors = validate(prompt, input_dir)
        state["calls"].append({"path": "/prompt", "valid": error is None})
        if error is not None:
            return JSONResponse({"error": error, "node_errors": node_errors}, status_code=400)
        prompt_id = str(uuid.uuid4())
        extra_data = dict(body.get("extra_data") or {})
        if "client_id" in body:
            extra_data["client_id"] = body["client_id"]
        outputs = [i for i, n in prompt.items() if n["class_type"] == "SaveImage"]
        state["history"][prompt_id] = {"prompt": [len(state["history"]), prompt_id, prompt, extra_data, outputs],
                                       "outputs": {},
                                       "status": {"status_str": None, "completed": False, "messages": []}}
        state["pending"].append((prompt_id, prompt, body.get("client_id")))
        if state["worker"] is None or state["worker"].done():
            state["worker"] = asyncio.get_running_loop().create_task(worker())
        return {"prompt_id": prompt_id, "number": len(state["history"]), "node_errors": {}}

    @app.get("/queue")
    async def queue():
        def item(prompt_id: str) -> list:
            return state["history"][prompt_id]["prompt"]

        return {"queue_running": [item(state["running"])] if state["running"] else [],
                "queue_pending": [item(prompt_id) for prompt_id, _, _ in state["pending"]]}

    @app.post("/queue")
    async def edit_queue(request: Request):
        body = await request.json()
        state["calls"].append({"path": "/queue", "body": body})
        if body.get("clear"):
            state["pending"].clear()
        drop = set(body.get("delete", []))
        state["pending"][:] = [p for p in state["pending"] if p[0] not in drop]
        return Response(status_code=200)

    @app.get("/history")
    async def history_all():
        return {k: v for k, v in state["history"].items() if v["status"]["status_str"]}

    @app.get("/history/{prompt_id}")
    async def history(prompt_id: str):
        entry = state["history"].get(prompt_id)
        return {prompt_id: entry} if entry and entry["status"]["status_str"] else {}

    @app.get("/view")
    async def view(filename: str, subfolder: str = "", type: str = "output"):
        path = output_dir / subfolder / filename
        if type != "output" or not path.is_file() or ".." in filename:
            return Response(status_code=404)
        return Response(path.read_bytes(), media_type="image/png")

    @app.get("/object_info")
    async def all_object_info():
        return {cls: object_info(cls, input_dir) for cls in NODES}

    @app.get("/object_info/{cls}")
    async def one_object_info(cls: str):
        return {cls: object_info(cls, input_dir)} if cls in NODES else {}

    @app.post("/upload/image")
    async def upload_image(request: Request):
        form = await request.form()
        image = form.get("image")
        state["calls"].append({"path": "/upload/image", "filename": getattr(image, "filename", None)})
        if image is None or not getattr(image, "filename", None):
            return Response(status_code=400)
        folder = input_dir / str(form.get("subfolder", ""))
        if ".." in image.filename or "/" in image.filename or ".." in str(form.get("subfolder", "")):
            return Response(status_code=400)
        folder.mkdir(parents=True, exist_ok=True)
        name = image.filename
        if str(form.get("overwrite", "")).lower() not in ("true", "1"):
            stem, dot, ext = name.rpartition(".")
            i = 1
            while (folder / name).exists():
                name = f"{stem} ({i}).{ext}" if dot else f"{image.filename} ({i})"
                i += 1
        (folder / name).write_bytes(await image.read())
        return {"name": name, "subfolder": str(form.get("subfolder", "")), "type": str(form.get("type", "input"))}

    @app.get("/system_stats")
    async def system_stats():
        free = VRAM_TOTAL - (VRAM_LOADED if state["loaded"] else 0) - (1 << 28)
        return {"system": {"os": "posix", "comfyui_version": "fake", "python_version": "3", "embedded_python": False},
                "devices": [{"name": "cpu", "type": "cpu", "index": None, "vram_total": VRAM_TOTAL,
                             "vram_free": free, "torch_vram_total": 0, "torch_vram_free": 0}]}

    @app.post("/free")
    async def free(request: Request):
        body = await request.json()
        state["calls"].append({"path": "/free", "body": body})
        if body.get("unload_models"):  # like ComfyUI, /free only sets a flag; the unload happens a moment later
            async def unload():
                await asyncio.sleep(0.5)
                state["loaded"] = False

            asyncio.get_running_loop().create_task(unload())
        return Response(status_code=200)

    @app.get("/_test/state")
    async def test_state():
        return {"loaded": state["loaded"]}

    @app.post("/interrupt")
    async def interrupt(request: Request):
        body = json.loads(await request.body() or b"{}")
        state["calls"].append({"path": "/interrupt", "body": body})
        # With a prompt_id, only that prompt is interrupted, and only while it runs; without, whatever runs.
        if body.get("prompt_id") in (None, state["running"]):
            state["interrupt"].set()
        return Response(status_code=200)

    @app.websocket("/ws")
    async def ws(websocket: WebSocket, clientId: str | None = None):  # noqa: N803 ComfyUI's parameter name
        await websocket.accept()
        client_id = clientId or uuid.uuid4().hex
        state["sockets"][client_id] = websocket
        await websocket.send_json({"type": "status", "data": {"status": {"exec_info": {"queue_remaining": 0}},
                                                              "sid": client_id}})
        try:
            while True:
                await websocket.receive_text()
        except WebSocketDisconnect:
            state["sockets"].pop(client_id, None)

    @app.post("/_test/behaviour")
    async def behaviour(request: Request):
        state["behaviour"] = await request.json()
        return state["behaviour"]

    @app.get("/_test/calls")
    async def calls():
        return state["calls"]

    return app


def main() -> None:
    import uvicorn

    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--output", required=True)
    parser.add_argument("--input", help="ComfyUI's input folder (default: beside --output, named input)")
    args = parser.parse_args()
    output = Path(args.output)
    output.mkdir(parents=True, exist_ok=True)
    inputs = Path(args.input) if args.input else output.parent / f"{output.name}-input"
    inputs.mkdir(parents=True, exist_ok=True)
    uvicorn.run(build_app(output, inputs), host="127.0.0.1", port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
