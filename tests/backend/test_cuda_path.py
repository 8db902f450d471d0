"""The CUDA path: its host-side pieces run here; what needs a GPU runs where there is one and skips here."""

import pytest
import torch

from backend import LLM, SamplingParams
from backend.engine.kv_budget import warm_up
from backend.loader import load_model, locate, read_config
from tests.backend.conftest import interpreted_only, prompts_of_lengths

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
# The device script's smoke mode is the CPU machine's check of it; where there is a GPU the script runs in full
# (and the device's Triton may be a release whose interpreter differs from the one these smoke runs are kept for).
cpu_machine_only = pytest.mark.skipif(torch.cuda.is_available(), reason="the smoke mode is for machines without a GPU")


def test_the_warm_up_batch_runs_through_a_throwaway_cache(tiny_dir):
    source = locate(str(tiny_dir("llama")))
    config, reader = read_config(source)
    model = load_model(source, config, reader, torch.float32, torch.device("cpu"), 512)
    blocks = warm_up(model, tokens=700, max_model_len=512, block_size=16, device=torch.device("cpu"),
                     dtype=torch.float32)
    assert blocks == 32 + 12  # 511 + 189 tokens in blocks of 16


def test_random_weight_models_take_token_ids(tmp_path):
    import json

    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["Qwen3ForCausalLM"], "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "max_position_embeddings": 256, "scriptorium_random_weights": True}))
    llm = LLM(str(tmp_path), block_size=16)
    # Seeded from config.json: a second load (say, the model as its own draft) is the same model.
    again = LLM(str(tmp_path), block_size=16).engine.model.state_dict()
    assert all(torch.equal(v, again[k]) for k, v in llm.engine.model.state_dict().items())
    out = llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 5 and out[0].outputs[0].text == ""
    with pytest.raises(ValueError, match="has no tokenizer: give prompts as token ids"):
        llm.generate("text", use_tqdm=False)


@needs_gpu
@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_graphs_and_kernels_match_eager_on_the_gpu(family, dtype, tiny_dir):
    prompts = prompts_of_lengths(3, 17, 33, 50)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    # Two engines share the card: each takes a quarter of it.
    eager = LLM(str(tiny_dir(family)), device="cuda", dtype=dtype, enforce_eager=True, gpu_memory_utilization=0.25)
    graphs = LLM(str(tiny_dir(family)), device="cuda", dtype=dtype, gpu_memory_utilization=0.25)
    a = [o.outputs[0].token_ids for o in eager.generate(prompts, params, use_tqdm=False)]
    b = [o.outputs[0].token_ids for o in graphs.generate(prompts, params, use_tqdm=False)]
    assert a == b
    if dtype == "float32":
        cpu = LLM(str(tiny_dir(family)), device="cpu")
        assert [o.outputs[0].token_ids for o in cpu.generate(prompts, params, use_tqdm=False)] == a


@needs_gpu
@pytest.mark.parametrize("enforce_eager", [True, False])  # CUDA graphs' memory pool counted in the budget
def test_kv_cache_is_sized_from_gpu_memory_utilization(enforce_eager, tmp_path):
    import gc
    import json

    # Large enough per block that the cache stays under the block cap on any card.
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["Qwen3ForCausalLM"], "vocab_size": 1024, "hidden_size": 1024, "intermediate_size": 2048,
        "num_hidden_layers": 8, "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
        "max_position_embeddings": 4096, "scriptorium_random_weights": True}))
    blocks = []
    for share in (0.2, 0.4):
        llm = LLM(str(tmp_path), device="cuda", dtype="bfloat16", gpu_memory_utilization=share,
                  enforce_eager=enforce_eager)
        assert bool(llm.engine.runner.graphs) != enforce_eager
        blocks.append(llm.engine.num_kv_blocks)
        used = torch.cuda.memory_reserved()
        assert used <= share * torch.cuda.get_device_properties(0).total_memory
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    assert blocks[1] > 1.9 * blocks[0] > 0


@cpu_machine_only
def test_the_device_benchmark_runs_in_smoke_mode():
    """bench/device.py on tiny shapes on the CPU (its kernels through the interpreter): every figure prints."""
    import json
    import os
    import subprocess
    import sys

    from tests.backend.server_process import ROOT

    result = subprocess.run([sys.executable, "bench/device.py", "--smoke"], capture_output=True, text=True,
                            cwd=ROOT, timeout=600, env={**os.environ, "TRITON_INTERPRET": "1"})
    assert result.returncode == 0, result.stderr[-2000:]
    rows = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    figures = [r["figure"] for r in rows]
    assert figures.count("decode_batch1") == 4 and "throughput" in figures and figures.count("fused_moe") == 2
    [offloaded] = [r for r in rows if r["figure"] == "decode_batch1_offloaded"]  # 2 of 8 experts per layer on the card
    assert offloaded["gpu_experts_per_layer"] == 2 and offloaded["tok_s"] > 0 and offloaded["pcie_bytes_per_token"] > 0
    # with and without the copies ahead on a guess of the next layer's routing
    assert offloaded["tok_s_without_copies_ahead"] > 0 and offloaded["copies_ahead_per_token"] > 0
    assert offloaded["copies_ahead_used_per_token"] >= 0 and offloaded["pcie_bytes_per_token_without_copies_ahead"] > 0
    # the same with the host's experts computed there (moe_cpu_compute): nothing copied, host pairs instead
    [computed] = [r for r in rows if r["figure"] == "decode_batch1_offloaded_cpu_compute"]
    assert computed["gpu_experts_per_layer"] == 2 and computed["tok_s"] > 0 and computed["host_pairs_per_token"] > 0
    # the Mixtral-shaped model in random Q4_K blocks
    q4_k = [r for r in rows if r.get("weights") == "Q4_K" and r["figure"] == "decode_batch1"]
    assert len(q4_k) == 1 and q4_k[0]["tok_s"] > 0 and q4_k[0]["weight_bytes_per_token"] > 0
    # The fused kernel computes what transformers' Mixtral block computes, on the same weights.
    assert all(r["relative_error_vs_transformers"] < 1e-4 for r in rows if r["figure"] == "fused_moe")
    # The block-wise quantized decode kernels beside the per-weight ones, a dense product and an MoE layer's step.
    gemv = [r for r in rows if r["figure"] == "quant_gemv"]
    assert [r["format"] for r in gemv] == ["Q4_K", "Q6_K"] and all(v > 0 for r in gemv for v in r["gb_s"].values())
    assert [r["tokens"] for r in rows if r["figure"] == "quant_moe_decode"] == [1]
    assert [(r["format"], r["rows_of_x"]) for r in rows if r["figure"] == "quant_gemm"] == [("Q4_K", 8), ("Q6_K", 8)]
    speculative = [r for r in rows if r["figure"] == "speculative_self_draft"]
    assert [r["identical"] for r in speculative] == [True, True]
    assert all(set(r["steps_replayed"]) == {"target", "draft"} for r in speculative)  # no graphs on the CPU: 0


@interpreted_only
@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
def test_a_padded_static_decode_batch_matches_the_eager_step(family, tiny_dir, monkeypatch):
    """What a CUDA graph replays: a decode batch written into the static inputs and padded to its bucket,
    run through the CUDA path's kernels (interpreted here). Its rows match the eager step; the padding
    rows write nothing into the cache."""
    from backend.engine.scheduler import ScheduledSeq

    monkeypatch.setenv("SCRIPTORIUM_TRITON", "1")
    engine = LLM(str(tiny_dir(family)), block_size=16).engine
    for i, prompt in enumerate(prompts_of_lengths(3, 20, 35)):
        engine.add_request(str(i), prompt, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    for _ in range(3):  # prompts in, then decodes
        engine.step()
    batch = [ScheduledSeq(seq, 1) for seq in engine.scheduler.running]
    assert len(batch) == 3 and all(item.computes_last_token for item in batch)
    runner = engine.runner
    runner.allocate_static(8, engine.max_model_len)
    runner.static["tables"].fill_(7)  # stale entries past each row's blocks must not matter
    caches = runner._attention_modules()
    before = [m.k_cache.clone() for m in caches]
    runner.fill_static(runner.lay_out(batch), 8)
    with torch.inference_mode():
        static = runner.model(*runner.static_args(8))
        written = [m.k_cache.clone() for m in caches]
        eager = runner.model(*runner.prepare(batch)[:3])
    torch.testing.assert_close(static[:3], eager, atol=1e-5, rtol=1e-5)
    slots = torch.tensor([item.seq.block_table[item.seq.num_computed_tokens // 16] * 16
                          + item.seq.num_computed_tokens % 16 for item in batch])
    for old, new, module in zip(before, written, caches):
        changed = (old != new).flatten(2).any(-1).flatten().nonzero().flatten()
        assert sorted(changed.tolist()) == sorted(slots.tolist())  # the three real rows, no padding row
        torch.testing.assert_close(new, module.k_cache, atol=1e-5, rtol=1e-5)  # the eager step wrote the same


def test_a_draft_model_sleeps_and_wakes_with_the_target(tiny_dir):
    """Sleep gives back the draft's cache (and weights, level 2) too; after waking, speculation still
    accepts every self-drafted token and the output is unchanged."""
    path = str(tiny_dir("llama"))
    prompts = prompts_of_lengths(5, 30)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    llm = LLM(path, block_size=16, speculative={"method": "draft", "model": path, "num_tokens": 3})
    expected = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    draft = llm.engine.proposer
    for level in (1, 2):
        attention = draft.runner._attention_modules()
        llm.engine.sleep(level)
        assert all(m.k_cache.numel() == 0 for m in attention)
        assert (draft.model is None) == (level == 2)
        llm.engine.wake_up()
        before = llm.engine.stats()
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == expected
        after = llm.engine.stats()
        drafted = after["spec_draft_tokens"] - before["spec_draft_tokens"]
        assert drafted > 0 and after["spec_accepted_tokens"] - before["spec_accepted_tokens"] == drafted


def test_the_kv_cache_gets_what_the_budget_leaves_after_weights_and_activations():
    from backend.engine.kv_budget import kv_cache_blocks

    gib, mib = 2**30, 2**20
    # 40 GiB allowed; 16 GiB of weights; the warm-up peaked at weights + its 1 GiB cache + 3 GiB of activations.
    assert kv_cache_blocks(40 * gib, 16 * gib, 20 * gib, 1 * gib, 60 * gib, mib, 40 * gib) == (40 - 16 - 3) * 1024
    with pytest.raises(ValueError, match=r"no room for a KV cache: gpu_memory_utilization=0.2 allows 18.0 GiB, "
                                         r"but the weights take 16.0 GiB and the activations of a full batch 3.0 GiB"):
        kv_cache_blocks(18 * gib, 16 * gib, 20 * gib, 1 * gib, 60 * gib, mib, 0.2)
    # Other programs hold the card: 10 GiB free beside our weights, 24 needed.
    with pytest.raises(ValueError, match=r"only 26.0 GiB of the card are free for this engine .* lower "
                                         r"gpu_memory_utilization to at most 26.0GiB"):
        kv_cache_blocks(40 * gib, 16 * gib, 20 * gib, 1 * gib, 10 * gib, mib, 0.5)


def test_gpu_memory_is_a_fraction_or_a_size_as_compose_yaml_writes_it():
    from backend.config import EngineConfig
    from common.sizes import parse_memory

    assert parse_memory("0.45") == 0.45 and parse_memory("1") == 1.0
    assert parse_memory("18GiB") == 18 * 2**30 and parse_memory("20GB") == 20 * 10**9
    assert parse_memory("512 MiB") == 512 * 2**20 and parse_memory("19327352832") == 19327352832
    for bad, message in (("18XB", "unknown unit"), ("1.5", "a fraction of the card is at most 1"),
                         ("lots", "is not a size such as 18GiB")):
        with pytest.raises(ValueError, match=message):
            parse_memory(bad)
    EngineConfig(model="m", gpu_memory_utilization=18 * 2**30)
    for bad in (0.0, 1.5, -3, True):
        with pytest.raises(ValueError, match="gpu_memory_utilization must be a fraction in"):
            EngineConfig(model="m", gpu_memory_utilization=bad)


def test_cpu_tensors_never_reach_compiled_kernels(monkeypatch):
    """SCRIPTORIUM_TRITON=1 runs the CUDA path's kernels on CPU tensors only under the interpreter: compiled, they
    would read host pointers as device memory. On a GPU machine the tests run compiled (tests/conftest.py)."""
    from backend.kernels import use_triton

    monkeypatch.setenv("SCRIPTORIUM_TRITON", "1")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(RuntimeError, match="set TRITON_INTERPRET=1 too"):
        use_triton(torch.zeros(1))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert use_triton(torch.zeros(1))
    monkeypatch.delenv("SCRIPTORIUM_TRITON")
    assert not use_triton(torch.zeros(1))


@cpu_machine_only
def test_the_device_check_script_runs_its_steps(tmp_path):
    """bench/device_check.sh, small, on the CPU: machine line, kernel tests, benchmark figures and a summary in
    $OUT, exit code 0 (on a GPU it runs the same steps in full)."""
    import json
    import os
    import subprocess
    import sys

    from tests.backend.server_process import ROOT

    env = {**os.environ, "OUT": str(tmp_path), "PYTHON": sys.executable, "DEVICE_CHECK_SMOKE": "1"}
    done = subprocess.run(["bash", "bench/device_check.sh"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["tests_rc"] == 0 and summary["bench_rc"] == 0
    assert "passed" in (tmp_path / "tests.log").read_text()
    figures = [json.loads(line)["figure"] for line in (tmp_path / "bench.jsonl").read_text().splitlines()]
    assert "decode_batch1_offloaded" in figures and figures[-1] == "total"
