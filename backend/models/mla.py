"""DeepSeek's multi-head latent attention (the mla layer kind): q through its low-rank path (q_a_proj, its norm,
q_b_proj) or one projection; keys and values compressed to one latent row a token (kv_a_proj_with_mqa, normed) and
a rotary key shared by every head; kv_b_proj expands the latent into each head's key and value. The paged cache
holds only the latent and the rotated key (kernels/mla_attention.py attends over them). Module names are the
Hugging Face checkpoints'."""

import torch
from torch import nn

from backend.kernels.mla_attention import HeadWeights, mla_attention, store_latent
from backend.kernels.rotary import apply_rotary
from backend.layer_spec import AttentionSpec
from backend.model_config import ModelConfig
from backend.models.transformer import RMSNorm

LATENT_NORM_EPS = 1e-6  # q_a_layernorm's and kv_a_layernorm's: DeepSeek's default, whatever rms_norm_eps says


class LatentAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, spec: AttentionSpec):
        super().__init__()
        m = spec.mla
        self.num_heads, self.shape = cfg.num_heads, m
        self.qk_head_dim = m.qk_nope_head_dim + m.qk_rope_head_dim
        h, q_width = cfg.hidden_size, cfg.num_heads * self.qk_head_dim
        self.q_lora = m.q_lora_rank is not None
        if self.q_lora:
            self.q_a_proj = nn.Linear(h, m.q_lora_rank, bias=cfg.qkv_bias)
            self.q_a_layernorm = RMSNorm(m.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(m.q_lora_rank, q_width, bias=False)
        else:
            self.q_proj = nn.Linear(h, q_width, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(h, m.kv_lora_rank + m.qk_rope_head_dim, bias=cfg.qkv_bias)
        self.kv_a_layernorm = RMSNorm(m.kv_lora_rank, LATENT_NORM_EPS)
        # read as its float weight (W_UK and W_UV), never through a matmul of its own: every loader keeps it in
        # floats (hf_quantize.KEEP, gguf_load's _FLOAT_KINDS)
        self.kv_b_proj = nn.Linear(
            m.kv_lora_rank, cfg.num_heads * (m.qk_nope_head_dim + m.v_head_dim), bias=False
        )
        self.o_proj = nn.Linear(cfg.num_heads * m.v_head_dim, h, bias=cfg.o_bias)
        # with YaRN's mscale squared where the config sets one (families/deepseek.py)
        self.scale = cfg.attention_scale or self.qk_head_dim**-0.5
        # Adjacent pairs gathered into halves, for q's and k's rotary parts alike (q . k is unchanged), so that the
        # rotate-half kernel rotates them
        self.pairs_adjacent = m.rope_interleaved
        # Bound by the model runner once the KV cache is allocated (v_cache is empty: the values are the latents).
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)
        # kv_b as our C kernel reads it, made at the first decode step on the CPU
        self.head_weights = HeadWeights()

    def forward(self, x: torch.Tensor, rope: list[tuple[torch.Tensor, torch.Tensor]], meta) -> torch.Tensor:
        t, m = x.shape[0], self.shape
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))) if self.q_lora else self.q_proj(x)
        q = q.view(t, self.num_heads, self.qk_head_dim)
        compressed = self.kv_a_proj_with_mqa(x)
        latent = self.kv_a_layernorm(compressed[:, : m.kv_lora_rank].contiguous())
        # q's rotary parts and the shared rotary key rotate together, as heads of one tensor
        pe = torch.cat([q[..., m.qk_nope_head_dim :], compressed[:, None, m.kv_lora_rank :]], dim=1)
        if self.pairs_adjacent:  # (x0, x1), (x2, x3), ... -> x0, x2, ..., x1, x3, ...
            pe = pe.unflatten(-1, (-1, 2)).transpose(-1, -2).flatten(-2)
        pe = apply_rotary(pe.contiguous(), *rope[0])
        store_latent(torch.cat([latent, pe[:, self.num_heads]], dim=-1), self.k_cache, meta.slot_mapping)
        out = mla_attention(
            q[..., : m.qk_nope_head_dim],
            pe[:, : self.num_heads],
            self.k_cache,
            self.kv_b_proj.weight,
            meta,
            self.scale,
            self.head_weights,
        )
        return self.o_proj(out.reshape(t, self.num_heads * m.v_head_dim))


def pack_head_weights(model: nn.Module) -> None:
    """Each latent attention layer's kv_b halves as our C decode rows read them, made at load (loader._pack_for_cpu)
    rather than at the first decode step, so that they are counted among what the loaded model holds."""
    for layer in (module for module in model.modules() if isinstance(module, LatentAttention)):
        m = layer.shape
        layer.head_weights.hold_at_load(layer.kv_b_proj.weight, layer.num_heads, m.qk_nope_head_dim, m.qk_rope_head_dim)
