"""A client for ComfyUI's HTTP and websocket API.

POST /prompt queues an API-format workflow under our client_id; /ws?clientId= reports its
progress (executing, progress, executed, execution_error, execution_interrupted,
execution_success); /history/{id} holds its outputs, fetched through /view.
"""

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import Callable

import httpx

from orchestrator.clients.comfyui_replies import (
    ComfyUIError,
    Interrupted,
    NodeError,
    choices,
    finished,
    first_id,
    node_order,
    outcome,
    validation_error,
)

OURS = {"scriptorium": True}  # extra_data every prompt we submit carries; ComfyUI keeps it in its queue entry
Progress = Callable[[dict], None]  # called with {"node": id, "value": n, "max": m} or {"node": id}


class ComfyUIClient:
    def __init__(self, base_url: str, timeout: float = 900.0):
        self.base_url = base_url.rstrip("/")
        self.timeout = timeout
        self.client_id = uuid.uuid4().hex
        self.http = httpx.AsyncClient(base_url=self.base_url, timeout=httpx.Timeout(60.0, connect=10.0))

    async def aclose(self) -> None:
        await self.http.aclose()

    async def __aenter__(self) -> "ComfyUIClient":
        return self

    async def __aexit__(self, *_) -> None:
        await self.aclose()

    async def _request(self, method: str, path: str, **kwargs) -> httpx.Response:
        try:
            return await self.http.request(method, path, **kwargs)
        except httpx.TimeoutException:
            raise ComfyUIError(f"ComfyUI at {self.base_url} did not answer {method} {path} within "
                               f"{self.http.timeout.read:.0f} s") from None
        except httpx.TransportError as e:
            raise ComfyUIError(f"cannot reach ComfyUI at {self.base_url} ({type(e).__name__}: {e}); is it running? "
                               "(SCRIPTORIUM_COMFYUI_URL)") from None

    async def system_stats(self) -> dict:
        return (await self._request("GET", "/system_stats")).json()

    async def object_info(self, node_class: str | None = None) -> dict:
        path = f"/object_info/{node_class}" if node_class else "/object_info"
        return (await self._request("GET", path)).json()

    async def model_files(self) -> dict[str, list[str]]:
        """The model files ComfyUI offers, by kind, as its loader nodes list them in /object_info."""
        kinds = {"checkpoints": ("CheckpointLoaderSimple", "ckpt_name"), "loras": ("LoraLoader", "lora_name"),
                 "vaes": ("VAELoader", "vae_name"), "upscalers": ("UpscaleModelLoader", "model_name")}
        info = await self.object_info()
        found = {}
        for kind, (node, name) in kinds.items():
            spec = (info.get(node) or {}).get("input", {})
            found[kind] = [str(c) for c in choices({**spec.get("required", {}), **spec.get("optional", {})}
                                                    .get(name)) or []]
        return found

    async def queue(self) -> dict:
        """GET /queue: {"queue_running": [...], "queue_pending": [...]}, items [number, prompt_id, prompt,
        extra_data, outputs]."""
        return (await self._request("GET", "/queue")).json()

    async def upload_image(self, data: bytes, filename: str, overwrite: bool = False) -> dict:
        """POST /upload/image (multipart, into the input folder): {"name", "subfolder", "type"}; ComfyUI renames
        the file ("x (1).png") when one of that name exists and overwrite is off."""
        response = await self._request("POST", "/upload/image", files={"image": (filename, data)},
                                       data={"type": "input", "overwrite": "true" if overwrite else "false"})
        if response.status_code != 200:
            raise ComfyUIError(f"ComfyUI at {self.base_url} refused the upload of {filename} "
                               f"({response.status_code}): {response.text[:200]}")
        return response.json()

    async def free(self, unload_models: bool = True, free_memory: bool = True) -> None:
        await self._request("POST", "/free", json={"unload_models": unload_models, "free_memory": free_memory})

    async def cancel(self, prompt_id: str) -> None:
        """Stop this prompt and only it: dropped from the queue if it has not started, interrupted if it is
        running. (A bare POST /interrupt would stop whatever runs, perhaps another client's prompt.)"""
        await self._request("POST", "/queue", json={"delete": [prompt_id]})
        await self._request("POST", "/interrupt", json={"prompt_id": prompt_id})

    async def _cancel_quietly(self, prompt_id: str) -> None:
        with contextlib.suppress(TimeoutError, ComfyUIError):
            await asyncio.wait_for(self.cancel(prompt_id), timeout=10)

    async def check_choices(self, workflow: dict) -> None:
        """Refuse, before submitting, a workflow naming a model file (or any other choice) ComfyUI does not have."""
        for node_id, node in workflow.items():
            if not isinstance(node, dict) or not isinstance(node.get("class_type"), str):
                raise ComfyUIError(f"workflow node {node_id} has no class_type; each node needs one, such as "
                                   "\"SaveImage\"")
        classes = sorted({node["class_type"] for node in workflow.values()})
        info = {}
        for cls in classes:
            data = await self.object_info(cls)
            if cls not in data:
                raise NodeError(first_id(workflow, cls), cls, "this node type is not installed in ComfyUI")
            info[cls] = data[cls]
        for node_id, node in workflow.items():
            spec = info[node["class_type"]].get("input", {})
            declared = {**spec.get("required", {}), **spec.get("optional", {})}
            for name, value in node.get("inputs", {}).items():
                allowed = choices(declared.get(name))
                if allowed is not None and isinstance(value, str) and value not in allowed:
                    shown = ", ".join(map(str, allowed[:20])) or "none"
                    raise NodeError(node_id, node["class_type"],
                                    f"{name} {value!r} is not available in ComfyUI; available: {shown}")

    async def submit(self, workflow: dict, extra_data: dict | None = None) -> str:
        body = {"prompt": workflow, "client_id": self.client_id, "extra_data": {**OURS, **(extra_data or {})}}
        response = await self._request("POST", "/prompt", json=body)
        if response.status_code == 400:
            raise validation_error(response)
        if response.status_code >= 400:
            raise ComfyUIError(f"ComfyUI at {self.base_url} refused the workflow ({response.status_code}): "
                               f"{response.text[:300]}")
        return response.json()["prompt_id"]

    async def history(self, prompt_id: str) -> dict | None:
        data = (await self._request("GET", f"/history/{prompt_id}")).json()
        return data.get(prompt_id)

    async def wait(self, prompt_id: str, on_progress: Progress | None = None,
                   should_stop: Callable[[], bool] | None = None) -> dict:
        """Follow a submitted prompt until it finishes; return its history entry. Falls back to polling
        /history when the websocket cannot be opened."""
        connection = await self._connect()
        try:
            return await self._follow(connection, prompt_id, on_progress, should_stop)
        finally:
            if connection is not None:
                await connection.close()

    async def _connect(self):
        """The progress websocket, or None where it cannot be opened (then we poll)."""
        import websockets

        ws_url = self.base_url.replace("http://", "ws://").replace("https://", "wss://") + \
            f"/ws?clientId={self.client_id}"
        try:
            return await websockets.connect(ws_url, max_size=None, open_timeout=10)
        except (TimeoutError, OSError, websockets.exceptions.WebSocketException):
            return None

    async def _follow(self, connection, prompt_id, on_progress, should_stop) -> dict:
        import websockets

        deadline = time.monotonic() + self.timeout
        if connection is None:
            return await self._wait_poll(prompt_id, should_stop, deadline)
        # The prompt may have finished before the socket opened: history settles that.
        entry = await self.history(prompt_id)
        if entry and finished(entry):
            return outcome(entry, prompt_id)
        while True:
            if should_stop and should_stop():
                await self.cancel(prompt_id)
                raise Interrupted(f"ComfyUI prompt {prompt_id} was interrupted (cancelled)")
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise ComfyUIError(f"ComfyUI at {self.base_url} did not finish prompt {prompt_id} within "
                                   f"{self.timeout:.0f} s")
            try:
                raw = await asyncio.wait_for(connection.recv(), timeout=min(remaining, 1.0))
            except TimeoutError:
                continue
            except websockets.exceptions.ConnectionClosed:
                return await self._wait_poll(prompt_id, should_stop, deadline)
            if isinstance(raw, bytes):
                continue  # binary frames carry live previews
            message = json.loads(raw)
            kind, data = message.get("type"), message.get("data", {})
            if data.get("prompt_id") not in (None, prompt_id):
                continue
            if kind == "progress" and on_progress:
                on_progress({"node": data.get("node"), "value": data.get("value"), "max": data.get("max")})
            elif kind == "executing" and data.get("prompt_id") == prompt_id:
                if data.get("node") is None:  # the end of this prompt, its history written
                    return await self._wait_poll(prompt_id, should_stop, deadline, interval=0.05)
                if on_progress:
                    on_progress({"node": data["node"]})
            elif kind == "execution_error":
                raise NodeError(str(data.get("node_id")), data.get("node_type", "?"),
                                data.get("exception_message", "execution failed").strip())
            elif kind == "execution_interrupted":
                raise Interrupted(f"ComfyUI prompt {prompt_id} was interrupted at node {data.get('node_id')}")
            elif kind == "execution_success":
                # ComfyUI sends this before it writes the prompt's history: wait for the entry.
                return await self._wait_poll(prompt_id, should_stop, deadline, interval=0.05)

    async def _wait_poll(self, prompt_id, should_stop, deadline, interval: float = 0.5) -> dict:
        while time.monotonic() < deadline:
            if should_stop and should_stop():
                await self.cancel(prompt_id)
                raise Interrupted(f"ComfyUI prompt {prompt_id} was interrupted (cancelled)")
            entry = await self.history(prompt_id)
            if entry and finished(entry):
                return outcome(entry, prompt_id)
            await asyncio.sleep(interval)
        raise ComfyUIError(f"ComfyUI at {self.base_url} did not finish prompt {prompt_id} within {self.timeout:.0f} s")

    async def download(self, image: dict) -> bytes:
        params = {"filename": image["filename"], "subfolder": image.get("subfolder", ""),
                  "type": image.get("type", "output")}
        response = await self._request("GET", "/view", params=params)
        if response.status_code != 200:
            raise ComfyUIError(f"ComfyUI at {self.base_url} has no output {image['filename']} ({response.status_code})")
        return response.content

    async def generate(self, workflow: dict, on_progress: Progress | None = None,
                       should_stop: Callable[[], bool] | None = None, extra_data: dict | None = None) -> list[bytes]:
        """Check, submit, follow and download: the images of every output node, in node order.
        extra_data: kept with the prompt in ComfyUI's queue (it marks the prompt as ours)."""
        await self.check_choices(workflow)
        connection = await self._connect()  # before submitting, so no progress message is missed
        try:
            prompt_id = await self.submit(workflow, extra_data)
            try:
                entry = await self._follow(connection, prompt_id, on_progress, should_stop)
            except asyncio.CancelledError:  # our caller gave up: the prompt must not run on without us
                await asyncio.shield(self._cancel_quietly(prompt_id))
                raise
        finally:
            if connection is not None:
                await connection.close()
        images = []
        for node_id in sorted(entry.get("outputs", {}), key=node_order):
            for image in entry["outputs"][node_id].get("images", []):
                if image.get("type", "output") == "output":
                    images.append(await self.download(image))
        if not images:
            raise ComfyUIError(f"ComfyUI prompt {prompt_id} finished without saving an image (no SaveImage node?)")
        return images
