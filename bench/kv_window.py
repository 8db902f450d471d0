"""KV bytes of a 32k-token prompt with and without window freeing, on a Gemma-3-shaped model: 5 of every 6 layers
slide over 1,024 positions (Gemma 3's 5:1 pattern and window), random weights at tiny widths (the bytes scale
with the widths; the ratio depends only on the layer pattern, the window and the step).

The prompt runs through the engine (2,048-token chunks, then decoding), and the block manager's own counts are
read after every step: the full group's blocks, and the sliding group's held blocks (engine/cache_groups.py), at
the step that finished the prompt (its last chunk's reach still held) and at the last decoding step. The
figure without window freeing is what the same blocks cost with every layer keeping every block (one pool, as
before the sliding group). One JSON line.

Run: python bench/kv_window.py [--prompt 32768 --window 1024 --step 2048 --tokens 8]
"""

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from backend import LLM, SamplingParams  # noqa: E402
from backend.engine.cache_groups import block_bytes  # noqa: E402
from tests.backend.tiny_models import build_model  # noqa: E402

BLOCK = 16


def window_freeing(prompt_tokens: int, window: int, step: int, tokens: int) -> dict:
    """The KV bytes a prompt of prompt_tokens holds with and without window freeing (the run's other counts too):
    step is max_num_batched_tokens, tokens the tokens decoded after the prompt."""
    with tempfile.TemporaryDirectory() as tmp:
        directory = build_model(
            "gemma3",
            Path(tmp) / "gemma3-shaped",
            num_hidden_layers=6,
            num_attention_heads=2,
            num_key_value_heads=1,
            sliding_window=window,
            max_position_embeddings=prompt_tokens + tokens + BLOCK,
            layer_types=["sliding_attention"] * 5 + ["full_attention"],
        )
        llm = LLM(
            str(directory),
            block_size=BLOCK,
            max_num_batched_tokens=step,
            max_num_seqs=1,
            max_model_len=prompt_tokens + tokens + BLOCK,
        )
        engine, manager = llm.engine, llm.engine.block_manager
        cfg = engine.model_config
        full_block, sliding_block = block_bytes(cfg, BLOCK, engine.shape.kv_dtype, True)
        every_block = sum(block_bytes(cfg, BLOCK, engine.shape.kv_dtype, False))
        prompt = torch.randint(
            3, cfg.vocab_size, (prompt_tokens,), generator=torch.Generator().manual_seed(0)
        ).tolist()
        engine.add_request("long", prompt, SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True))
        start, peak, steps = time.perf_counter(), 0, []
        while engine.has_unfinished_requests():
            engine.step()
            full = manager.num_blocks - manager.num_free_blocks
            windowed = full * full_block + manager.window.held() * sliding_block
            peak = max(peak, windowed)
            steps.append((full, manager.window.held(), windowed))
        seconds = time.perf_counter() - start
        # the step that finished the prompt
        prefilled = next(s for s in steps if s[0] * BLOCK >= prompt_tokens)
        decoding = [s for s in steps if s[0]][-1]  # the last step before the sequence finished and gave all back
        return {
            "bench": "kv_window",
            "model": f"gemma3-shaped: 6 layers, 5 sliding over {window} positions, "
            f"hidden {cfg.hidden_size}, {cfg.num_kv_heads} kv head of {cfg.head_dim}",
            "prompt_tokens": prompt_tokens,
            "step_tokens": step,
            "block_size": BLOCK,
            "kv_bytes_without_window_freeing": prefilled[0] * every_block,
            "kv_bytes_with_window_freeing": prefilled[2],
            "fraction": round(prefilled[2] / (prefilled[0] * every_block), 4),
            # decoding after the prompt: the last chunk's reach given back, each window's blocks alone held
            "kv_bytes_decoding": decoding[2],
            "fraction_decoding": round(decoding[2] / (prefilled[0] * every_block), 4),
            "sliding_blocks_held_decoding": decoding[1],
            "peak_kv_bytes_with_window_freeing": peak,
            "peak_fraction": round(peak / (prefilled[0] * every_block), 4),
            "full_blocks": prefilled[0],
            "sliding_blocks_held": prefilled[1],
            "sliding_blocks_held_peak": max(s[1] for s in steps),
            "sliding_pool_blocks": engine.runner.sliding.num_blocks,
            "allocated_cache_bytes": sum(
                t.numel() * t.element_size()
                for layer in engine.model.model.layers
                for t in (layer.self_attn.k_cache, layer.self_attn.v_cache)
            ),
            "seconds": round(seconds, 1),
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt", type=int, default=32768)
    parser.add_argument("--window", type=int, default=1024)
    parser.add_argument("--step", type=int, default=2048, help="max_num_batched_tokens")
    parser.add_argument("--tokens", type=int, default=8, help="tokens decoded after the prompt")
    args = parser.parse_args()
    print(json.dumps(window_freeing(args.prompt, args.window, args.step, args.tokens)))


if __name__ == "__main__":
    main()
