"""The embedded default's context for agents: `serve` gives smollm2 32768 tokens (YaRN x4 over its 8192), 65536
with --max-model-len 65536 (x8); the offline LLM keeps the trained 8192, exact against transformers."""

import json

import httpx

from backend import LLM
from backend.__main__ import main
from tests.backend.server_process import ServerProcess


def test_serve_gives_smollm2_32768_tokens_and_reports_them(smollm2_path):
    server = ServerProcess("smollm2", "--max-num-seqs", "4")
    try:
        card = httpx.get(f"{server.url}/v1/models").json()["data"][0]
        assert card["max_model_len"] == 32768
        r = httpx.post(f"{server.url}/v1/completions", json={"model": "smollm2", "prompt": [7] * 32768,
                                                              "max_tokens": 1})
        assert r.status_code == 400 and "32768" in r.json()["error"]["message"]
        r = httpx.post(f"{server.url}/v1/completions", json={"model": "smollm2", "prompt": "The capital of France is",
                                                              "max_tokens": 4, "temperature": 0})
        assert r.status_code == 200 and r.json()["choices"][0]["text"]
    finally:
        server.stop()


def test_one_option_gives_65536_and_a_path_keeps_the_files_context(smollm2_path, capsys):
    for args, length in ((["--max-model-len", "65536"], 65536), (["--model", str(smollm2_path)], 8192),
                         (["--rope-scaling", "yarn:8"], 65536), (["--rope-scaling", "none"], 8192)):
        assert main(["serve", *args, "--print-memory-need"]) == 0
        assert json.loads(capsys.readouterr().out)["models"][0]["max_model_len"] == length


def test_the_offline_llm_keeps_the_trained_length_unscaled(smollm2_path):
    engine = LLM("smollm2", num_kv_blocks=512).engine
    assert engine.max_model_len == 8192 and engine.model_config.rope_scaling is None
