"""Several models behind one server: routing by `model`, /v1/models, and unloading to fit a budget.

The oracle for every answer is a single-model server on the same model and settings."""

import asyncio
import json
import time
from pathlib import Path

import httpx
import openai
import pytest

from backend.server.serve import named_models
from tests.backend.server_process import ServerProcess
from tests.backend.tiny_models import build_model

SETTINGS = ("--dtype", "float32", "--max-model-len", "256", "--num-kv-blocks", "32", "--max-num-seqs", "4")
PROMPTS = ["The scribe copied", "A quick apprentice"]


def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


def answers(server: ServerProcess, name: str) -> list[str]:
    c = client(server)
    texts = [
        c.completions.create(model=name, prompt=p, max_tokens=10, temperature=0).choices[0].text
        for p in PROMPTS
    ]
    chat = c.chat.completions.create(
        model=name, messages=[{"role": "user", "content": PROMPTS[0]}], max_tokens=10, temperature=0
    )
    return [*texts, chat.choices[0].message.content]


def statuses(server: ServerProcess) -> dict[str, str]:
    return {m["id"]: m["status"] for m in httpx.get(f"{server.url}/v1/models").json()["data"]}


def loads(server: ServerProcess) -> int:
    return sum(m["loads"] for m in httpx.get(f"{server.url}/v1/models").json()["data"])


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("multi")
    # Two families, so that an answer from the wrong model cannot pass for the right one.
    return {
        "alpha": str(build_model("llama", root / "alpha")),
        "beta": str(build_model("qwen2", root / "beta")),
    }


@pytest.fixture(scope="module")
def single(models) -> dict[str, tuple[list[str], int]]:
    """Each model alone behind a server: its answers, and the memory it says it holds."""
    out = {}
    servers = {name: ServerProcess(path, "--served-model-name", name, *SETTINGS, wait=False)
               for name, path in models.items()}  # started together: their start-ups overlap
    try:
        for name, server in servers.items():
            server.wait_ready()
            (card,) = httpx.get(f"{server.url}/v1/models").json()["data"]
            out[name] = answers(server, name), card["memory_bytes"]
    finally:
        assert [server.stop() for server in servers.values()] == [0] * len(servers)
    return out


@pytest.fixture(scope="module")
def oracle(single) -> dict[str, list[str]]:
    out = {name: texts for name, (texts, _) in single.items()}
    assert out["alpha"] != out["beta"]
    return out


def test_memory_is_the_weights_and_the_kv_cache(models, single):
    for name, path in models.items():
        config = json.loads((Path(path) / "config.json").read_text())
        head_dim = config["hidden_size"] // config["num_attention_heads"]
        kv = 32 * 2 * config["num_hidden_layers"] * 16 * config["num_key_value_heads"] * head_dim * 4
        weights = sum(p.stat().st_size for p in Path(path).glob("*.safetensors"))  # fp32, as served
        assert abs(single[name][1] - (weights + kv)) < 0.1 * (weights + kv), name


@pytest.fixture(scope="module")
def budgeted(models, single):
    """Both models behind one server whose memory budget holds either one but not both."""
    needs = [memory for _, memory in single.values()]
    budget = int(max(needs) * 1.2)
    assert max(needs) < budget < sum(needs)
    server = ServerProcess(
        f"alpha={models['alpha']}",
        *SETTINGS,
        "--model",
        f"beta={models['beta']}",
        "--models-memory",
        str(budget),
    )
    yield server
    assert server.stop() == 0


def test_models_lists_both_and_the_first_is_loaded_at_start(budgeted, models):
    data = httpx.get(f"{budgeted.url}/v1/models").json()["data"]
    assert [(m["id"], m["root"]) for m in data] == [("alpha", models["alpha"]), ("beta", models["beta"])]
    assert statuses(budgeted) == {"alpha": "loaded", "beta": "unloaded"}
    assert data[0]["max_model_len"] == 256 and "max_model_len" not in data[1]


def test_each_model_answers_as_alone_and_the_budget_unloads_the_other(budgeted, oracle):
    assert answers(budgeted, "beta") == oracle["beta"]  # loaded on first use: alpha made room
    assert statuses(budgeted) == {"alpha": "unloaded", "beta": "loaded"}
    assert httpx.get(f"{budgeted.url}/health").json() == {"status": "ok"}  # the default being out is no fault
    assert answers(budgeted, "alpha") == oracle["alpha"]  # reloaded from disk, same answers
    assert statuses(budgeted) == {"alpha": "loaded", "beta": "unloaded"}
    # /metrics labels every sample with its model: three requests each so far, ten tokens apiece
    text = httpx.get(f"{budgeted.url}/metrics").text
    for name in ("alpha", "beta"):
        assert f'scriptorium_requests_total{{model="{name}",outcome="length"}} 3.0' in text
        assert f'scriptorium_generation_tokens_total{{model="{name}"}} 30.0' in text
        assert f'scriptorium_kv_cache_usage_ratio{{model="{name}"}} 0.0' in text  # unloaded ones read 0


def test_concurrent_requests_to_both_models_are_all_answered_right(budgeted, oracle):
    async def one(c: openai.AsyncOpenAI, name: str, prompt: str) -> tuple[str, str]:
        out = await c.completions.create(model=name, prompt=prompt, max_tokens=10, temperature=0)
        return name, prompt, out.choices[0].text

    async def main():
        async with openai.AsyncOpenAI(
            base_url=f"{budgeted.url}/v1", api_key="unused", max_retries=0, timeout=120
        ) as c:
            return await asyncio.gather(
                *(one(c, n, p) for n in ("alpha", "beta", "alpha", "beta") for p in PROMPTS)
            )

    before = loads(budgeted)
    for name, prompt, text in asyncio.run(main()):
        assert text == oracle[name][PROMPTS.index(prompt)]
    assert sorted(statuses(budgeted).values()) == ["loaded", "unloaded"]
    # Each load serves every request that waited for it, so the two models do not swap per request.
    assert loads(budgeted) - before <= 3


def test_streams_hold_their_model_until_they_end(budgeted, oracle):
    c = client(budgeted)
    # Long enough that alpha's load comes while beta still generates: beta is unloaded only after it.
    stream = c.completions.create(
        model="beta",
        prompt=PROMPTS[0],
        max_tokens=200,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    first = next(iter(stream))
    other = c.completions.create(model="alpha", prompt=PROMPTS[1], max_tokens=10, temperature=0)
    rest = [chunk for chunk in stream if chunk.choices]
    assert (first.choices[0].text + "".join(ch.choices[0].text for ch in rest)).startswith(oracle["beta"][0])
    assert rest[-1].choices[0].finish_reason == "length"
    assert other.choices[0].text == oracle["alpha"][1]


def test_an_unknown_model_is_404_naming_the_param(budgeted):
    c = client(budgeted)
    with pytest.raises(openai.NotFoundError) as e:
        c.chat.completions.create(model="gamma", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert e.value.code == "model_not_found" and e.value.param == "model"
    assert "`alpha`" in e.value.message and "`beta`" in e.value.message
    for path, body in [
        ("/v1/embeddings", {"model": "gamma", "input": "hi"}),
        ("/v1/responses", {"model": "gamma", "input": "hi"}),
        ("/tokenize", {"model": "gamma", "prompt": "hi"}),
    ]:
        r = httpx.post(f"{budgeted.url}{path}", json=body)
        assert r.status_code == 404 and r.json()["error"]["param"] == "model", path


def test_max_loaded_models_counts_and_a_short_load_timeout_is_503(models, oracle):
    server = ServerProcess(
        f"alpha={models['alpha']}",
        *SETTINGS,
        "--model",
        f"beta={models['beta']}",
        "--max-loaded-models",
        "1",
        "--load-timeout",
        "0",
    )
    try:
        r = httpx.post(
            f"{server.url}/v1/completions", json={"model": "beta", "prompt": "hi", "max_tokens": 2}
        )
        assert r.status_code == 503 and r.headers["retry-after"] and "loading" in r.json()["error"]["message"]
        deadline = time.monotonic() + 60
        while statuses(server)["beta"] != "loaded":  # the load goes on without the request that began it
            assert time.monotonic() < deadline
            time.sleep(0.1)
        assert statuses(server) == {"alpha": "unloaded", "beta": "loaded"}
        assert answers(server, "beta") == oracle["beta"]
    finally:
        assert server.stop() == 0


def test_a_failed_load_is_tried_again_by_the_next_request(models, oracle, tmp_path):
    """A model that could not load (here its config.json is being rewritten) is not failed for good: the next
    request for it loads it again, and the server's other model is untouched meanwhile."""
    import shutil

    gamma = tmp_path / "gamma"
    shutil.copytree(models["beta"], gamma)
    config = (gamma / "config.json").read_text()
    (gamma / "config.json").write_text(config[: len(config) // 2])  # half written
    server = ServerProcess(f"alpha={models['alpha']}", *SETTINGS, "--model", f"gamma={gamma}")
    try:
        r = httpx.post(f"{server.url}/v1/completions", json={"model": "gamma", "prompt": "hi", "max_tokens": 2},
                       timeout=60)
        message = r.json()["error"]["message"]
        assert r.status_code == 503 and "could not be loaded" in message and "config.json" in message
        cards = {m["id"]: m for m in httpx.get(f"{server.url}/v1/models").json()["data"]}
        assert cards["gamma"]["status"] == "error" and "not valid JSON" in cards["gamma"]["error"]
        assert httpx.get(f"{server.url}/health").status_code == 200  # alpha serves on
        (gamma / "config.json").write_text(config)
        assert answers(server, "gamma") == oracle["beta"]
        cards = {m["id"]: m for m in httpx.get(f"{server.url}/v1/models").json()["data"]}
        assert cards["gamma"]["status"] == "loaded" and "error" not in cards["gamma"] and cards["gamma"]["loads"] == 1
    finally:
        assert server.stop() == 0


def test_named_models_parses_names_and_refuses_clashes():
    assert named_models(None, None) == [("smollm2", "smollm2")]
    assert named_models(["smollm2", "big=/models/Qwen3-8B", "/m/a=b.gguf"], None) == [
        ("smollm2", "smollm2"),
        ("big", "/models/Qwen3-8B"),
        ("/m/a=b.gguf", "/m/a=b.gguf"),
    ]
    assert named_models(["/m/x"], "x") == [("x", "/m/x")]
    with pytest.raises(ValueError, match="NAME=MODEL"):
        named_models(["a=/m/x", "a=/m/y"], None)
    with pytest.raises(ValueError, match="single --model"):
        named_models(["/m/x", "/m/y"], "x")
