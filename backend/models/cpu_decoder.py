"""A decode step in one call of our C kernels (backend/csrc/cpu_decoder.c) on the CPU.

The C loop runs the kernels the modules would call, in their order, so the hidden states are the same bits as
the module path's (a test holds it to that); it covers models whose every linear layer was repacked for our
quantized kernel (a GGUF file, or an HF checkpoint quantized at load; a fused layer's parts each in its own
format), with or without biases (Qwen2), q/k norms (per head: Qwen3; over all of q and of k: OLMoE), Granite's
multipliers, rotary (none in SmolLM3's NoPE layers) and a sliding window (each layer's own), and MoE layers whose
router is fp32 and whose experts are in our layout (Mixtral, Qwen3-MoE, OLMoE; Qwen2-MoE's gated and Granite-MoE's
ungated shared experts), and latent attention layers (DeepSeek-V2's MLA, their kv_b read as mla_attention's C rows
read it, up to its C_ROWS rows) with V2's softmax router, and Gemma 3: its (1 + w) norms (1 + w taken here once, the
same fp32 sum the module takes each call), the sandwich of norms around each branch, GELU's tanh form (the C kernel
the module calls too) and a rotary table per layer kind (the step's rows carry every table, each layer reads its
own); partial rotary (Phi-4-mini: each head's leading dimensions rotated as the module rotates them); and the
hybrid Qwen3-Next and Qwen3.5-MoE: their Gated DeltaNet layers (cpu_deltanet.c, which the module's decode rows call
too, on the state pool's slots the step's metadata names) and their full-attention layers' output gate; and
gpt-oss: attention sinks, the router's bias, the experts' biases and clamped SwiGLU (the module's C calls).
DeepSeek-V3's and GLM's routers stay with the modules (their logits are torch's matmul there).
The runner builds one per KV cache (the cache's and the state pool's addresses are in it) and uses it for steps
whose rows all attend as decode rows, up to max_rows of them (kernels/step_paths.py: a hybrid's rows are then each
one token of its own sequence).
"""

import ctypes

import torch

from backend.kernels import native
from backend.kernels.attention import AttentionMetadata
from backend.kernels.mla_attention import C_ROWS, c_rows_fit
from backend.kernels.moe_torch import c_reads
from backend.models.gated_deltanet import DeltaNetWeights, GatedDeltaNet
from backend.models.mla import LatentAttention
from backend.models.mlp import MLP
from backend.models.moe import SparseMoE
from backend.models.transformer import Attention, CausalLM, RMSNorm
from backend.quant.cpu_parts import QuantMatrix
from backend.quant.experts import ExpertStack, QuantExperts, one_call_tokens
from backend.quant.modules import QuantLinear

i64, ptr = ctypes.c_int64, ctypes.c_void_p


class _Linear(ctypes.Structure):
    _fields_ = [("parts", QuantMatrix * 3), ("count", i64), ("rows", i64), ("bias", ptr)]


class _Experts(ctypes.Structure):
    _fields_ = [("router", ptr), ("experts", i64), ("top_k", i64), ("renormalize", i64), ("gate", ExpertStack),
                ("up", ExpertStack), ("down", ExpertStack), ("shared_gate", ptr), ("shared_gate_up", _Linear),
                ("shared_down", _Linear), ("shared_inter", i64), ("router_bias", ptr), ("bias_gate_up", ptr),
                ("bias_down", ptr), ("alpha", ctypes.c_float), ("limit", ctypes.c_float)]


class _Latent(ctypes.Structure):
    _fields_ = [("q_a", _Linear), ("q", _Linear), ("kv_a", _Linear), ("q_a_norm", ptr), ("kv_a_norm", ptr),
                ("w_uk", ptr), ("w_uv", ptr), ("uk_scales", ptr), ("uv_scales", ptr), ("uk_hs", i64), ("uv_hs", i64),
                ("lora", i64), ("nope", i64), ("rope", i64), ("v", i64), ("interleaved", i64), ("eps", ctypes.c_float)]


class _Layer(ctypes.Structure):
    _fields_ = [("input_norm", ptr), ("post_norm", ptr), ("q_norm", ptr), ("k_norm", ptr), ("qkv", _Linear),
                ("o", _Linear), ("gate_up", _Linear), ("down", _Linear), ("moe", _Experts), ("k_cache", ptr),
                ("v_cache", ptr), ("window", i64), ("rope", i64), ("qk_norm_full", i64), ("mla", ptr),
                ("pre_ff_norm", ptr), ("post_ff_norm", ptr), ("rope_offset", i64), ("output_gate", i64),
                ("linear", ptr), ("ba", _Linear), ("sinks", ptr)]


class _Shape(ctypes.Structure):
    _fields_ = [("layers", i64), ("hidden", i64), ("heads", i64), ("kv_heads", i64), ("head_dim", i64),
                ("inter", i64), ("top_k", i64), ("block_size", i64), ("eps", ctypes.c_float),
                ("scale", ctypes.c_float), ("final_norm", ptr), ("kv_kind", i64), ("residual_scale", ctypes.c_float),
                ("gelu", i64), ("rotary_dim", i64), ("proj_width", i64), ("attn_width", i64)]


def _linear(linear) -> _Linear | None:
    """A QuantLinear whose parts were all repacked for our kernel (and whose bias is fp32), or None."""
    if not isinstance(linear, QuantLinear) or len(linear.parts) > 3:
        return None
    bias = linear.bias
    if bias is not None and not (native.usable(bias) and bias.is_contiguous()):
        return None
    parts = []
    for w in linear.parts:
        if w.layout is None or w.lead:
            return None
        lay = w.layout
        offsets = w.offsets.data_ptr() if lay.offsets else None
        parts.append(QuantMatrix(w.codes.data_ptr(), w.scales.data_ptr(), offsets, w.rows, w.cols, lay.group,
                                  lay.bits, lay.scale_kind, lay.order_code))
    return _Linear((QuantMatrix * 3)(*parts), len(parts), linear.out_features,
                   bias.data_ptr() if bias is not None else None)


def _experts(moe: SparseMoE) -> _Experts | None:
    """A MoE layer the C loop computes as its modules do (route_rows, moe_tokens, then add_shared), or None."""
    experts = moe.experts
    if moe.expert_cache is not None or not isinstance(experts, QuantExperts) or not experts.packed() \
            or not c_reads(moe.gate, bias=True) or moe.router != "softmax_topk" \
            or moe.spec.routed_scaling_factor != 1.0:
        return None
    biases = [moe.gate.bias, moe.w_gate_up_bias, moe.w_down_bias]  # gpt-oss's (fp32 as the module's C call takes them)
    if any(b is not None and not (native.usable(b) and b.is_contiguous()) for b in biases):
        return None
    shared = [None, _Linear(), _Linear(), 0]
    if moe.shared_expert is not None:
        mlp, gate = moe.shared_expert, moe.shared_expert_gate  # gate None: Granite-MoE's ungated shared expert
        shared = [gate.weight.data_ptr() if gate is not None else None, _linear(mlp.gate_up_proj),
                  _linear(mlp.down_proj), mlp.down_proj.in_features]
        if (gate is not None and not c_reads(gate, 1)) or None in shared[1:3]:
            return None
    alpha, limit = moe.spec.clamped_swiglu or (0.0, 0.0)
    return _Experts(moe.gate.weight.data_ptr(), moe.gate.weight.shape[0], moe.top_k, int(moe.renormalize),
                    *experts.stacks(), *shared, *(b.data_ptr() if b is not None else None for b in biases), alpha,
                    limit)


def _latent(attn: LatentAttention) -> tuple[_Latent, list[torch.Tensor]] | None:
    """A latent attention layer whose projections were repacked for our kernel and whose widths cpu_mla.c takes
    (as the module's decode rows then run it), and the tensors it points into; or None."""
    m, w_kv_b = attn.shape, attn.kv_b_proj.weight
    if not c_rows_fit(m.qk_nope_head_dim, m.qk_rope_head_dim, m.kv_lora_rank, m.v_head_dim) \
            or not native.usable(w_kv_b) or m.v_head_dim > attn.qk_head_dim:  # its output fits attention's rows
        return None
    q_a, q = (_linear(attn.q_a_proj), _linear(attn.q_b_proj)) if attn.q_lora else (_Linear(), _linear(attn.q_proj))
    kv_a = _linear(attn.kv_a_proj_with_mqa)
    if q_a is None or q is None or kv_a is None:
        return None
    held = attn.head_weights.refresh(w_kv_b, attn.num_heads, m.qk_nope_head_dim)  # the module's, made now
    keep = [held.uk, held.uv, *(s for s in (held.uk_scales, held.uv_scales) if s is not None)]

    def address(t: torch.Tensor | None) -> int | None:
        return None if t is None else t.data_ptr()

    q_a_norm = attn.q_a_layernorm.weight if attn.q_lora else None
    return _Latent(q_a, q, kv_a, address(q_a_norm), attn.kv_a_layernorm.weight.data_ptr(), held.uk.data_ptr(),
                   held.uv.data_ptr(), address(held.uk_scales), address(held.uv_scales), held.uk.stride(0),
                   held.uv.stride(0), m.kv_lora_rank, m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim,
                   int(attn.pairs_adjacent), attn.kv_a_layernorm.eps), keep


def _deltanet(attn: GatedDeltaNet) -> tuple[DeltaNetWeights, _Linear, _Linear, _Linear] | None:
    """A linear-attention layer whose projections were repacked for our kernel (no biases) and whose weights and
    states cpu_deltanet.c takes: its weights' struct, q|k|v|z, b|a and out_proj; or None."""
    weights = attn.c_weights()
    linears = [_linear(attn.in_proj_qkvz), _linear(attn.in_proj_ba), _linear(attn.out_proj)]
    if weights is None or any(w is None or w.bias for w in linears):
        return None
    return weights, *linears


def _norms(layer) -> list[RMSNorm | None]:
    """The layer's norms in _Layer's order: input, post-attention, q, k (None without q/k norms), pre- and
    post-feedforward (None without Gemma's sandwich); then a latent attention's (q_a's where q has its low-rank
    path, kv_a's)."""
    attn, latent = layer.self_attn, isinstance(layer.self_attn, LatentAttention)
    norms = [layer.input_layernorm, layer.post_attention_layernorm]
    norms += [attn.q_norm, attn.k_norm] if isinstance(attn, Attention) and attn.qk_norm else [None, None]
    norms += [layer.pre_feedforward_layernorm, layer.post_feedforward_layernorm] if layer.sandwich else [None, None]
    return norms + ([attn.q_a_layernorm if attn.q_lora else None, attn.kv_a_layernorm] if latent else [])


def _scale(norm: RMSNorm | None) -> torch.Tensor | None:
    """What the C loop multiplies a norm's rows by: Gemma's 1 + w (the module's fp32 sum), else the weight."""
    if norm is None:
        return None
    return 1.0 + norm.weight.float() if norm.unit_offset else norm.weight


class CpuDecoder:
    def __init__(self, model: CausalLM, layers: list[_Layer], shape: _Shape, max_rows: int | None,
                 held: list | None = None):
        self.model = model  # held: its weights and caches are what the pointers point into
        # held too: what layers point to besides the model's tensors (the latent layers' structs and kv_b's halves,
        # Gemma's 1 + w)
        self.held = held or []
        self.layers, self.shape = (_Layer * len(layers))(*layers), shape
        # A MoE model's experts of more rows are faster in the module path's per-expert loop (experts.py)
        self.max_rows = max_rows

    @classmethod
    def build(cls, model: CausalLM) -> "CpuDecoder | None":
        """For a model on the CPU whose layers the C loop covers, with its KV cache allocated; else None."""
        cfg, modules = model.config, model.model.layers
        if not all(isinstance(layer.self_attn, (Attention, LatentAttention, GatedDeltaNet)) for layer in modules):
            return None  # the C loop runs full, sliding, latent and linear attention; the modules any other kind
        attention = [layer.self_attn for layer in modules if not isinstance(layer.self_attn, GatedDeltaNet)]
        final_norm, scales = _scale(model.model.norm), [[_scale(n) for n in _norms(layer)] for layer in modules]
        held = [final_norm] + [w for layer in scales for w in layer if w is not None]
        if not attention or not native.enabled() or not all(native.usable(w) and w.is_contiguous() for w in held):
            return None
        layers, top_k, inter, proj_width, attn_width = [], 0, cfg.intermediate_size, 0, 0
        for layer, norms in zip(modules, scales):
            attn, mlp = layer.self_attn, layer.mlp
            if not isinstance(attn, GatedDeltaNet) and attn.k_cache.numel() == 0:
                return None  # a cache not yet bound
            if isinstance(attn, Attention) and not (attn.sinks is None or native.usable(attn.sinks)):
                return None
            mla = _latent(attn) if isinstance(attn, LatentAttention) else None
            if isinstance(attn, LatentAttention) and mla is None:
                return None
            if mla is not None:
                held += [mla[0], *mla[1]]
            if isinstance(mlp, MLP):
                ffn, moe = [_linear(mlp.gate_up_proj), _linear(mlp.down_proj)], _Experts()
            elif isinstance(mlp, SparseMoE) and cfg.hidden_act == "silu":
                ffn, moe = [_Linear(), _Linear()], _experts(mlp)
                top_k = max(top_k, mlp.top_k)
                inter = max(inter, moe.shared_inter if moe is not None else 0)
            else:
                return None
            if moe is None or any(p is None for p in ffn):
                return None
            norms = [w.data_ptr() if w is not None else None for w in norms[:6]]
            if isinstance(attn, GatedDeltaNet):
                linear = _deltanet(attn)
                if linear is None:
                    return None
                weights, qkvz, ba, out = linear
                held.append(weights)
                proj_width = max(proj_width, qkvz.rows + ba.rows)
                attn_width = max(attn_width, attn.value_size)
                layers.append(_Layer(*norms[:4], qkvz, out, *ffn, moe, None, None, 0, 0, 0, None, *norms[4:], 0, 0,
                                     ctypes.addressof(weights), ba))
                continue
            parts = [_Linear() if mla is not None else _linear(attn.qkv_proj), _linear(attn.o_proj)]
            if any(p is None for p in parts):
                return None
            if mla is not None:
                layers.append(_Layer(*norms[:4], *parts, *ffn, moe, attn.k_cache.data_ptr(), None, 0, 1, 0,
                                     ctypes.addressof(mla[0]), *norms[4:], 0))
                continue
            proj_width = max(proj_width, parts[0].rows)
            layers.append(_Layer(*norms[:4], *parts, *ffn, moe, attn.k_cache.data_ptr(), attn.v_cache.data_ptr(),
                                 attn.sliding_window or 0, int(attn.rope), int(attn.qk_norm == "full"), None,
                                 *norms[4:], attn.rope_table * 2 * cfg.rotary_dim,  # __call__'s rows of tables
                                 int(attn.output_gate), None, _Linear(),
                                 attn.sinks.data_ptr() if attn.sinks is not None else None))
        first = attention[0]
        shape = _Shape(cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                       inter, top_k, first.k_cache.shape[1], cfg.rms_norm_eps, first.scale,
                       final_norm.data_ptr(), native.KV_KINDS[first.k_cache.dtype], cfg.residual_multiplier,
                       int(cfg.hidden_act == "gelu_pytorch_tanh"), cfg.rotary_dim, proj_width, attn_width)
        max_rows = one_call_tokens() if top_k else None
        if isinstance(first, LatentAttention):  # the module's latent rows run in cpu_mla.c up to C_ROWS, in torch beyond
            max_rows = min(max_rows or C_ROWS, C_ROWS)
        return cls(model, layers, shape, max_rows, held)

    def takes(self, rows: int) -> bool:
        return self.max_rows is None or rows <= self.max_rows

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Hidden states [rows, hidden] of a step whose rows all attend as decode rows."""
        x = self.model.model.embed(input_ids).contiguous()
        cos_sin = self.model.cos_sin[positions]  # [rows, 2, head_dim] fp32
        if self.model.own_cos_sin is not None:  # each row's tables side by side: [rows, tables, 2, head_dim]
            cos_sin = torch.cat([cos_sin[:, None], self.model.own_cos_sin[:, positions].transpose(0, 1)], dim=1)
        tables, lens, slots = meta.decode_block_tables, meta.decode_context_lens, meta.slot_mapping
        window = meta.sliding or meta  # sliding layers' slots and tables (engine/cache_groups.py)
        d = cos_sin.shape[-1]  # the rotary dimensions: each head's (or its leading part's), a latent layer's rope
        states = meta.states  # a hybrid model's linear layers: each row's state slot, and whether it starts fresh
        fresh = (lens == 1).to(torch.uint8) if states is not None else None
        done = native.library().decode_layers(
            self.layers, ctypes.byref(self.shape), x.data_ptr(), x.shape[0], cos_sin.data_ptr(),
            cos_sin.data_ptr() + 4 * d, cos_sin.stride(0), slots.data_ptr(), tables.data_ptr(), tables.stride(0), lens.data_ptr(),
            tables.shape[1] * self.shape.block_size, window.slot_mapping.data_ptr(),
            window.decode_block_tables.data_ptr(), window.decode_block_tables.stride(0),
            states.slots.data_ptr() if states is not None else None,
            fresh.data_ptr() if fresh is not None else None, torch.get_num_threads())
        if not done:
            raise MemoryError(f"no memory for the scratch of a {x.shape[0]}-row decode step: lower --max-num-seqs")
        return x
