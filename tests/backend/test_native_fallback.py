"""Without a C compiler the backend still runs, on its torch path, and says so once: the same greedy tokens as our
CPU kernels give (tiny random models are sharp enough that fp32 rounding does not flip them)."""

import json
import os
import subprocess
import sys

from backend import LLM, SamplingParams
from backend.kernels import native

SCRIPT = """
import json, sys
from backend import LLM, SamplingParams
from backend.kernels import native
llm = LLM(sys.argv[1], block_size=8)
out = llm.generate([[1, 5, 9, 2, 7], [3, 3]], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                   use_tqdm=False)
print(json.dumps({"native": native.library() is not None, "tokens": [o.outputs[0].token_ids for o in out]}))
"""


def test_a_machine_without_a_compiler_runs_the_torch_path_with_one_warning(tiny_gguf, tmp_path):
    path, _ = tiny_gguf("llama")
    env = dict(os.environ, CC=str(tmp_path / "no-such-cc"), SCRIPTORIUM_HOME=str(tmp_path / "home"))
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(path)], capture_output=True, text=True, env=env,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["native"] is False
    assert done.stderr.count("no CPU kernels") == 1 and "no-such-cc" in done.stderr
    if native.library() is not None:  # and the kernels, here, give the same tokens
        llm = LLM(str(path), block_size=8)
        out = llm.generate([[1, 5, 9, 2, 7], [3, 3]], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                           use_tqdm=False)
        assert [o.outputs[0].token_ids for o in out] == got["tokens"]
