import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

# Tests never write to the user's data directory: a run-wide home unless the caller chose one (CI does).
os.environ.setdefault("SCRIPTORIUM_HOME", str(Path(__file__).resolve().parent.parent / ".home"))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Without a GPU, Triton kernels run on the CPU through Triton's interpreter (set before any module defines a
# kernel); with one they are compiled, so that the CUDA tests and graph capture test what users run.
if "TRITON_INTERPRET" not in os.environ:
    import torch

    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"


@pytest.fixture(autouse=True)
def _fresh_disk_prefix_cache():
    """Each test starts without the KV blocks earlier tests' engines wrote to the run-wide home's disk prefix cache
    (backend/engine/disk_prefix_cache.py): a cold run in one test would otherwise be served from another's."""
    writer = sys.modules.get("backend.engine.disk_kv_writer")
    if writer is not None:  # an earlier test's engine may still be writing
        writer.finish_writes()
    shutil.rmtree(Path(os.environ["SCRIPTORIUM_HOME"]) / "cache" / "kv", ignore_errors=True)


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    from backend.model_store import pull

    return pull("smollm2")


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """tiny_dir(name) -> the directory of that family's tiny checkpoint, built once per session."""
    from tests.backend.tiny_models import build_model

    root = tmp_path_factory.mktemp("tiny-models")
    built: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in built:
            built[name] = build_model(name, root / name)
        return built[name]

    return get


# Services shared by the orchestrator and MCP tests -----------------------------------------------------

@pytest.fixture(scope="module")
def tiny_server(tiny_dir):
    """The real backend serving tiny_dir("llama") as `tiny`, started once for each test module that asks."""
    from tests.backend.server_process import ServerProcess

    server = ServerProcess(str(tiny_dir("llama")), "--served-model-name", "tiny")
    yield server
    server.stop()


@pytest.fixture(scope="session")
def llm_server(tmp_path_factory):
    """The real backend serving two tiny random models: `tiny` (the default, with a context long enough for the
    pipeline's prompts) and `tiny-qwen`, loaded on first use, as a multi-model server lists and routes them."""
    from tests.backend.server_process import ServerProcess
    from tests.backend.tiny_models import build_model

    root = tmp_path_factory.mktemp("models")
    model = build_model("llama", root / "tiny-long", max_position_embeddings=4096)
    other = build_model("qwen2", root / "tiny-qwen", max_position_embeddings=1024)
    server = ServerProcess(f"tiny={model}", "--model", f"tiny-qwen={other}", "--max-num-seqs", "16")
    yield server
    server.stop()


class FakeComfyUI:
    """The ComfyUI stand-in of tests/orchestrator/fake_comfyui.py, as a real process on a free port."""

    def __init__(self, output: Path):
        from tests.backend.server_process import ROOT, free_port

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.input_dir = output.parent / f"{output.name}-input"  # ComfyUI's input folder (uploads land here)
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.orchestrator.fake_comfyui", "--port",
                                      str(self.port), "--output", str(output)], cwd=ROOT,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                httpx.get(f"{self.url}/system_stats", timeout=1)
                return
            except httpx.TransportError:
                time.sleep(0.1)
        raise TimeoutError("fake ComfyUI did not start")

    def behave(self, **behaviour) -> None:
        httpx.post(f"{self.url}/_test/behaviour", json=behaviour).raise_for_status()

    def calls(self) -> list[dict]:
        return httpx.get(f"{self.url}/_test/calls").json()

    def queue(self) -> dict:
        return httpx.get(f"{self.url}/queue").json()

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=10)


@pytest.fixture
def comfyui(tmp_path):
    fake = FakeComfyUI(tmp_path / "comfy-output")
    yield fake
    fake.stop()


