import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from orchestrator.settings import Settings
from tests.backend.server_process import ROOT, ServerProcess, free_port
from tests.backend.tiny_models import build_model


@pytest.fixture(scope="session")
def llm_server(tmp_path_factory):
    """The real backend serving a tiny random model with a context long enough for the pipeline's prompts."""
    model = build_model("llama", tmp_path_factory.mktemp("models") / "tiny-long", max_position_embeddings=4096)
    server = ServerProcess(str(model), "--served-model-name", "tiny", "--max-num-seqs", "16")
    yield server
    server.stop()


class FakeComfyUI:
    def __init__(self, output: Path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
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

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=10)


@pytest.fixture
def comfyui(tmp_path):
    fake = FakeComfyUI(tmp_path / "comfy-output")
    yield fake
    fake.stop()


@pytest.fixture
def settings(tmp_path, llm_server, comfyui) -> Settings:
    return Settings(home=tmp_path / "home", llm_urls=(f"{llm_server.url}/v1",), comfyui_url=comfyui.url)


def run_cli(settings: Settings, *args: str, timeout: float = 600, extra_env: dict | None = None):
    env = {**os.environ, "SCRIPTORIUM_HOME": str(settings.home), "SCRIPTORIUM_LLM_URL": settings.llm_urls[0],
           **(extra_env or {})}
    env.pop("SCRIPTORIUM_COMFYUI_URL", None)
    if settings.comfyui_url:
        env["SCRIPTORIUM_COMFYUI_URL"] = settings.comfyui_url
    return subprocess.run([sys.executable, "-m", "orchestrator", *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=ROOT)
