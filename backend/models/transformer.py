"""The decoder-only transformer shared by every supported family.

Each layer is built from its own LayerSpec (backend/layer_spec.py): full or sliding-window attention, with or
without rotary (SmolLM3's NoPE layers), q/k RMSNorm per head (Qwen3) or over the whole q and k (OLMoE), and a
sigmoid gate on its output (Qwen3-Next), or linear attention (models/gated_deltanet.py); a
dense or sparse (MoE) feed-forward; the rotary table of its own base where it has one (Gemma 3's local layers).
What stays model-wide is in ModelConfig: q/k/v and o biases (Qwen2), the rotating part of each head (Phi's partial
rotary), Granite's embedding, residual, attention and logits scalars, Gemma's (1 + w) norms around each branch,
GELU and logits softcap.
Module names follow the Hugging Face checkpoints, except that q/k/v and gate/up are fused (as Phi-3's checkpoints
store them).
"""

import torch
from torch import nn

from backend.kernels import native
from backend.kernels.attention import AttentionMetadata, paged_attention, store_kv
from backend.kernels.norm import add_rms_norm, rms_norm
from backend.kernels.rotary import apply_rotary, model_cos_sin
from backend.layer_spec import AttentionSpec, LayerSpec
from backend.model_config import ModelConfig, ModelLoadError
from backend.models.gated_deltanet import GatedDeltaNet
from backend.models.mlp import MLP
from backend.models.moe import SparseMoE


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, unit_offset: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        self.unit_offset = unit_offset  # Gemma's: scales by (1 + weight), the checkpoint's weight kept as it is

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if self.unit_offset:
            return self._offset_norm(x, residual)
        if residual is None:
            return rms_norm(x, self.weight, self.eps)
        return add_rms_norm(x, residual, self.weight, self.eps)

    def _offset_norm(self, x: torch.Tensor, residual: torch.Tensor | None):
        # As Gemma computes it: (1 + weight) in fp32, applied to the input in fp32, cast back after the weight;
        # the residual sum in the compute dtype.
        scale = 1.0 + self.weight.float()
        if x.dtype == torch.float32:
            return rms_norm(x, scale, self.eps) if residual is None else add_rms_norm(x, residual, scale, self.eps)
        summed = x if residual is None else x + residual
        out = rms_norm(summed.float(), scale, self.eps).to(x.dtype)
        return out if residual is None else (out, summed)


def _norm(cfg: ModelConfig, size: int) -> RMSNorm:
    return RMSNorm(size, cfg.rms_norm_eps, cfg.norm_unit_offset)


def rope_bases(cfg: ModelConfig) -> list[float | None]:
    """The rotary tables the layers read: None (the model's rope_theta and rope_scaling) first, then each base a
    layer has of its own (AttentionSpec.rope_theta), unscaled."""
    return [None, *sorted({spec.attention.rope_theta for spec in cfg.layers} - {None})]


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, spec: AttentionSpec):
        super().__init__()
        self.rope_table = rope_bases(cfg).index(spec.rope_theta)  # which (cos, sin) of the step's it rotates by
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        # Qwen3-Next's output gate: q's projection is twice as wide, each head's query then its gate's columns
        self.output_gate = spec.output_gate
        self.q_width = self.q_size * (2 if spec.output_gate else 1)
        self.scale = cfg.attention_scale or self.head_dim ** -0.5  # Granite's attention_multiplier where set
        self.sliding_window = spec.window
        self.rope = spec.rope
        self.rotary_dim = cfg.rotary_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_width + 2 * self.kv_size, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=cfg.o_bias)
        self.qk_norm = spec.qk_norm
        if spec.qk_norm:  # over each head (Qwen3), or over all of q and all of k (OLMoE)
            full = spec.qk_norm == "full"
            self.q_norm = _norm(cfg, self.q_size if full else self.head_dim)
            self.k_norm = _norm(cfg, self.kv_size if full else self.head_dim)
        # gpt-oss's: a learned logit a head in each of its softmaxes' denominators
        self.sinks = nn.Parameter(torch.empty(self.num_heads)) if spec.sinks else None
        # Bound by the model runner once the KV cache is allocated.
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)

    def forward(self, x: torch.Tensor, rope: list[tuple[torch.Tensor, torch.Tensor]],
                meta: AttentionMetadata) -> torch.Tensor:
        t = x.shape[0]
        qkv = self.qkv_proj(x)
        qw, gate = self.q_width, None
        v = qkv[:, qw + self.kv_size:].view(t, self.num_kv_heads, self.head_dim)
        q_cols = qkv[:, :qw]
        if self.output_gate:
            q_cols, gate = q_cols.view(t, self.num_heads, 2, self.head_dim).unbind(2)
            q_cols, gate = q_cols.reshape(t, self.q_size), gate.reshape(t, self.q_size)
        if self.qk_norm:
            width = self.q_norm.weight.shape[0]  # head_dim, or q_size for a norm over all of q
            q = self.q_norm(q_cols.reshape(-1, width)).view(t, self.num_heads, self.head_dim)
            k = self.k_norm(qkv[:, qw:qw + self.kv_size].reshape(-1, self.k_norm.weight.shape[0]))
            qk = torch.cat([q, k.view(t, self.num_kv_heads, self.head_dim)], dim=1)
        elif self.output_gate:
            qk = torch.cat([q_cols, qkv[:, qw:qw + self.kv_size]], dim=1).view(t, -1, self.head_dim)
        else:  # q and k are adjacent columns: rotate them as one tensor of heads
            qk = qkv[:, :self.q_size + self.kv_size].view(t, self.num_heads + self.num_kv_heads, self.head_dim)
        qk = self._rotate(qk, *rope[self.rope_table]) if self.rope else qk.contiguous()
        q, k = qk[:, :self.num_heads], qk[:, self.num_heads:]
        if self.sliding_window is not None and meta.sliding is not None:  # its own pool's slots and tables
            meta = meta.sliding
        store_kv(k, v, self.k_cache, self.v_cache, meta.slot_mapping)
        out = paged_attention(q, self.k_cache, self.v_cache, meta, self.scale, self.sliding_window, self.sinks)
        out = out.reshape(t, self.q_size)
        return self.o_proj(out if gate is None else sigmoid_gate(out, gate))

    def _rotate(self, qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if self.rotary_dim == self.head_dim:
            return apply_rotary(qk, cos, sin)
        rot = self.rotary_dim  # the leading dimensions rotate as a head of their own, the rest pass through
        return torch.cat([apply_rotary(qk[..., :rot].contiguous(), cos, sin), qk[..., rot:]], dim=-1)


def sigmoid_gate(out: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """out * sigmoid(gate), rows [t, width]: in place by our C kernel on the CPU (the one-call step's, so both
    compute the same bits), else torch's."""
    if native.usable(out, gate) and out.is_contiguous() and gate.stride(1) == 1:
        native.library().sigmoid_mul_rows(out.data_ptr(), gate.data_ptr(), out.shape[0], out.shape[1], gate.stride(0))
        return out
    return out * torch.sigmoid(gate)


def attention_module(cfg: ModelConfig, spec: AttentionSpec) -> nn.Module:
    """A layer's attention, by its kind; each holds the k_cache and v_cache the model runner allocates for it
    (AttentionSpec.block_shapes) and takes (x, rope, meta)."""
    if spec.kind in ("full", "sliding"):
        return Attention(cfg, spec)
    if spec.kind == "linear":
        return GatedDeltaNet(cfg, spec)
    if spec.kind == "mla":
        from backend.models.mla import LatentAttention  # it builds on this module's RMSNorm

        return LatentAttention(cfg, spec)
    raise ModelLoadError(f"{cfg.architecture}: {spec.kind} attention is not supported yet")


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, spec: LayerSpec):
        super().__init__()
        self.self_attn = attention_module(cfg, spec.attention)
        if spec.mlp.kind == "moe":
            self.mlp = SparseMoE(cfg, spec.mlp)
        else:
            self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias, act=cfg.hidden_act)
        self.input_layernorm = _norm(cfg, cfg.hidden_size)
        self.post_attention_layernorm = _norm(cfg, cfg.hidden_size)
        self.sandwich = cfg.sandwich_norms
        if self.sandwich:  # Gemma: post_attention_layernorm norms the attention's output, these the MLP's in and out
            self.pre_feedforward_layernorm = _norm(cfg, cfg.hidden_size)
            self.post_feedforward_layernorm = _norm(cfg, cfg.hidden_size)
        self.residual_multiplier = cfg.residual_multiplier

    def forward(self, x, residual, rope, meta):
        """x: the last branch's output, not yet added to residual (None before the first layer)."""
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self._branch(self.self_attn(x, rope, meta))
        if self.sandwich:
            x, residual = self.pre_feedforward_layernorm(self.post_attention_layernorm(x), residual)
            return self.post_feedforward_layernorm(self.mlp(x)), residual
        x, residual = self.post_attention_layernorm(x, residual)
        return self._branch(self.mlp(x)), residual

    def _branch(self, x: torch.Tensor) -> torch.Tensor:
        """A branch's output as it is added to the residual stream (Granite scales it first)."""
        return x if self.residual_multiplier == 1.0 else x * self.residual_multiplier


class DecoderModel(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        if len(cfg.layers) != cfg.num_layers:  # a config reader that forgot to describe its layers
            raise ValueError(f"{cfg.architecture}: {len(cfg.layers)} layer specs for {cfg.num_layers} layers")
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList([DecoderLayer(cfg, spec) for spec in cfg.layers])
        self.norm = _norm(cfg, cfg.hidden_size)
        self.embedding_multiplier = cfg.embedding_multiplier
        self.multiplier_in_dtype = cfg.embedding_multiplier_in_dtype

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        if self.embedding_multiplier == 1.0:
            return x
        if self.multiplier_in_dtype:  # Gemma's sqrt(hidden), rounded to the compute dtype first as transformers does
            return x * torch.tensor(self.embedding_multiplier, dtype=x.dtype)
        return x * self.embedding_multiplier  # Granite's

    def forward(self, input_ids, rope, meta):
        x, residual = self.embed(input_ids), None
        for layer in self.layers:
            x, residual = layer(x, residual, rope, meta)
        x, _ = self.norm(x, residual)
        return x


class CausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, max_positions: int):
        super().__init__()
        self.config = cfg
        self.model = DecoderModel(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.tie_weights()
        # indexed by each row's place in the table: its position, offset where RoPE switches by length
        self.register_buffer("cos_sin", model_cos_sin(cfg, max_positions), persistent=False)
        # Layers' own bases: cast with the model (loader.py rebuilds only cos_sin), which rounds them as the cast
        # of each step's rows would; None where every layer rotates by the model's table.
        own = [model_cos_sin(cfg, max_positions, theta) for theta in rope_bases(cfg)[1:]]
        self.register_buffer("own_cos_sin", torch.stack(own) if own else None, persistent=False)

    def tie_weights(self) -> None:
        # A GGUF's quantized table is shared by module instead (backend/quant/gguf_load.py).
        if self.config.tie_word_embeddings and isinstance(self.lm_head, nn.Linear):
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Hidden states [num_tokens, hidden] of a flattened batch."""
        dtype = self.model.norm.weight.dtype  # the compute dtype
        tables = [self.cos_sin[positions].to(dtype)]
        if self.own_cos_sin is not None:
            tables += list(self.own_cos_sin[:, positions].to(dtype))
        return self.model(input_ids, [(t[:, 0], t[:, 1]) for t in tables], meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden).float()
        if self.config.logits_scaling != 1.0:
            logits = logits / self.config.logits_scaling  # Granite's
        cap = self.config.final_logit_softcap  # Gemma's, where its config sets one
        return logits if cap is None else torch.tanh(logits / cap) * cap
