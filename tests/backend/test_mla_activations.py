"""The activation estimate that `--print-memory-need` and moe_gpu_experts="auto" reserve before a model is loaded
covers what a latent attention layer really allocates: traced op by op (live_bytes.py) while a tiny DeepSeek-V2 in
bf16 runs a prompt in two chunks, the second reading the first one's latents too, then decodes. A chunk expands
every position it reads, so `--print-memory-need` sizes it at max_model_len."""

import json

import torch

from backend import LLM, SamplingParams
from backend.__main__ import main
from backend.engine.kv_budget import activation_bytes
from backend.quant.attention_sizes import attention_activation_bytes
from tests.backend.conftest import prompts_of_lengths
from tests.backend.live_bytes import LiveBytes

CHUNK, PROMPT = 160, 320  # chunks past mla_attention.ABSORBED_ROWS: expanded, as every chunk is on CUDA


def test_the_estimate_covers_what_a_latent_attention_layer_allocates(tiny_dir):
    llm = LLM(
        str(tiny_dir("deepseek_v2")),
        dtype="bfloat16",
        block_size=16,
        max_model_len=PROMPT + 8,
        max_num_batched_tokens=CHUNK,
        long_prefill_token_threshold=CHUNK,
        enable_prefix_caching=False,
    )
    cfg = llm.engine.model_config
    attention = llm.engine.model.model.layers[0].self_attn
    forward, steps = attention.forward, []

    def traced(x, rope, meta):
        with LiveBytes() as live:
            out = forward(x, rope, meta)
        steps.append((x.shape[0], live.peak))
        return out

    attention.forward = traced
    greedy = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    llm.generate(prompts_of_lengths(PROMPT), greedy, use_tqdm=False)
    assert [tokens for tokens, _ in steps][:2] == [CHUNK, CHUNK]  # the prompt's two chunks, then decode rows
    peak = max(p for _, p in steps)
    estimate = attention_activation_bytes(cfg, CHUNK, PROMPT, 2)
    # The layer's output (hidden-wide) is one of the hidden states' copies that activation_bytes counts apart.
    assert peak <= estimate + CHUNK * cfg.hidden_size * 2
    assert estimate <= 1.5 * peak  # an estimate, not a multiple of what is held
    # What the server reserves: twice every part, the attention's at a chunk that reaches max_model_len
    reserved = activation_bytes(cfg, CHUNK, 1, torch.bfloat16, context=PROMPT)
    assert reserved >= 2 * peak and reserved > activation_bytes(cfg, CHUNK, 1, torch.bfloat16)


def test_print_memory_need_sizes_a_latent_chunk_at_max_model_len(tiny_dir, capsys):
    """At the same step size, a longer max_model_len lets a chunk read more positions: more activations for the
    latent attention, the same for GLM-4.5-shaped grouped-query attention, whose kernels read the cache in place."""

    def activations(max_model_len: int) -> dict[str, int]:
        models = ["--model", f"v2={tiny_dir('deepseek_v2')}", "--model", f"glm={tiny_dir('glm4_moe')}"]
        args = ["serve", *models, "--max-model-len", str(max_model_len), "--max-num-batched-tokens", "64"]
        assert main([*args, "--dtype", "bfloat16", "--print-memory-need"]) == 0
        return {m["name"]: m["activation_bytes"] for m in json.loads(capsys.readouterr().out)["models"]}

    short, long = activations(128), activations(256)
    assert long["v2"] > short["v2"] and long["glm"] == short["glm"]
