"""The decoder-only transformer shared by every supported family.

Families differ only by flags of ModelConfig: q/k/v biases (Qwen2), per-head q/k RMSNorm
(Qwen3), sliding windows (Mistral), and a sparse feed-forward in some layers (MoE).
Module names follow the Hugging Face checkpoints, except that q/k/v and gate/up are fused.
"""

import torch
from torch import nn

from backend.kernels.attention import AttentionMetadata, paged_attention, store_kv
from backend.kernels.norm import add_rms_norm, rms_norm
from backend.kernels.rotary import apply_rotary, cos_sin_table
from backend.model_config import ModelConfig
from backend.models.mlp import MLP
from backend.models.moe import SparseMoE


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            return rms_norm(x, self.weight, self.eps)
        return add_rms_norm(x, residual, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim ** -0.5
        self.sliding_window = cfg.sliding_window
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=cfg.o_bias)
        self.qk_norm = cfg.qk_norm
        if cfg.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        # Bound by the model runner once the KV cache is allocated.
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        t = x.shape[0]
        qkv = self.qkv_proj(x)
        v = qkv[:, self.q_size + self.kv_size:].view(t, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q = self.q_norm(qkv[:, :self.q_size].reshape(t, self.num_heads, self.head_dim))
            k = self.k_norm(qkv[:, self.q_size:self.q_size + self.kv_size].reshape(t, self.num_kv_heads, self.head_dim))
            qk = torch.cat([q, k], dim=1)
        else:  # q and k are adjacent columns: rotate them as one tensor of heads
            qk = qkv[:, :self.q_size + self.kv_size].view(t, self.num_heads + self.num_kv_heads, self.head_dim)
        qk = apply_rotary(qk, cos, sin)
        q, k = qk[:, :self.num_heads], qk[:, self.num_heads:]
        store_kv(k, v, self.k_cache, self.v_cache, meta.slot_mapping)
        out = paged_attention(q, self.k_cache, self.v_cache, meta, self.scale, self.sliding_window)
        return self.o_proj(out.reshape(t, self.q_size))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int):
        super().__init__()
        self.self_attn = Attention(cfg)
        if cfg.layer_is_moe(index):
            self.mlp = SparseMoE(cfg)
        else:
            self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, residual, cos, sin, meta):
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, cos, sin, meta)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class DecoderModel(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList([DecoderLayer(cfg, i) for i in range(cfg.num_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, input_ids, cos, sin, meta):
        x, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            x, residual = layer(x, residual, cos, sin, meta)
        x, _ = self.norm(x, residual)
        return x


class CausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, max_positions: int):
        super().__init__()
        self.config = cfg
        self.model = DecoderModel(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.tie_weights()
        table = cos_sin_table(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, max_positions)
        self.register_buffer("cos_sin", table, persistent=False)

    def tie_weights(self) -> None:
        # A GGUF's quantized table is shared by module instead (backend/quant/gguf_load.py).
        if self.config.tie_word_embeddings and isinstance(self.lm_head, nn.Linear):
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Hidden states [num_tokens, hidden] of a flattened batch."""
        cos_sin = self.cos_sin[positions].to(self.model.norm.weight.dtype)  # the compute dtype
        return self.model(input_ids, cos_sin[:, 0], cos_sin[:, 1], meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()
