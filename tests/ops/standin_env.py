"""Put the vLLM and SGLang stand-ins (tests/ops/engine_standins.py) where ops' process runner finds the real ones:
a `vllm` program on PATH, and a `sglang.launch_server` module for `python -m`."""

import os
import sys
from pathlib import Path

from tests.backend.server_process import ROOT


def standin_env(root: Path) -> dict[str, str]:
    bin_dir, packages = root / "bin", root / "site"
    (packages / "sglang").mkdir(parents=True, exist_ok=True)
    bin_dir.mkdir(parents=True, exist_ok=True)
    vllm = bin_dir / "vllm"
    vllm.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m tests.ops.engine_standins vllm "$@"\n')
    vllm.chmod(0o755)
    (packages / "sglang" / "__init__.py").write_text("")
    (packages / "sglang" / "launch_server.py").write_text(
        "import sys\n\nfrom tests.ops.engine_standins import sglang_main\n\nsglang_main(sys.argv[1:])\n")
    return {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
            "PYTHONPATH": os.pathsep.join([str(ROOT), str(packages)])}
