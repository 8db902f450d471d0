import os
import subprocess
import sys

import pytest

from common.settings import Settings
from tests.backend.server_process import ROOT


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


