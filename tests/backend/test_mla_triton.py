"""The latent attention on the CUDA path, run on the CPU (TRITON_INTERPRET=1): the Triton decode kernel over the
paged latent cache against the torch rows, and a DeepSeek-V3-shaped model end to end with CUDA graphs captured and
replayed (tests/backend/cuda_emulation.py), its greedy tokens the CPU path's."""

import pytest
import torch

from backend.kernels import mla_triton
from backend.kernels.mla_attention import absorbed_attention
from tests.backend.conftest import interpreted_only, on_kernel_device, prompts_of_lengths
from tests.backend.cuda_emulation import capture_graphs, cpu_tokens_then_emulated, greedy_tokens, replays

pytestmark = interpreted_only


def test_the_latent_decode_kernel_is_the_torch_rows():
    """20 heads (a tile of 16 and a partial one), rows of other lengths over shuffled blocks, a padding row of
    length 0 (a graph's): the attended latents, through W_UV, are the torch path's."""
    torch.manual_seed(0)
    heads, nope, rope, v, lora, block = 20, 16, 8, 12, 32, 4
    cache = torch.randn(9, block, 1, lora + rope)
    w_kv_b = torch.randn(heads * (nope + v), lora) * 0.2
    tables = torch.tensor([[5, 2, 0, 3, 1, 7], [8, 4, 6, 0, 0, 0], [1, 0, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0]])
    lens = torch.tensor([23, 9, 1, 0])
    q_nope, q_pe = torch.randn(4, heads, nope), torch.randn(4, heads, rope)
    expected = absorbed_attention(q_nope[:3], q_pe[:3], cache, w_kv_b, tables[:3], lens[:3], 0.3)
    w = w_kv_b.view(heads, -1, lora)
    q = torch.cat([torch.einsum("nhd,hdl->nhl", q_nope, w[:, :nope]), q_pe], dim=-1)
    latent = on_kernel_device(mla_triton.latent_decode, q, cache, tables, lens, 0.3, lora)
    torch.testing.assert_close(
        torch.einsum("nhl,hvl->nhv", latent[:3], w[:, nope:]), expected, atol=1e-5, rtol=1e-5
    )
    assert not latent[3].any()


@pytest.mark.parametrize("spec", [None, {"method": "ngram", "num_tokens": 3, "prompt_lookup_min": 1}])
def test_a_latent_attention_model_with_graphs_keeps_the_cpu_paths_tokens(spec, tiny_dir, monkeypatch):
    prompts = prompts_of_lengths(3, 21, 40)
    settings = dict(block_size=16, max_num_seqs=4, max_model_len=256, speculative=spec)
    expected, llm = cpu_tokens_then_emulated(monkeypatch, str(tiny_dir("deepseek_v3")), prompts, **settings)
    [runner] = capture_graphs(llm)
    assert greedy_tokens(llm, prompts) == expected
    assert replays(runner) > 0
