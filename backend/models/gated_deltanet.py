"""The Gated DeltaNet layer (linear attention) of Qwen3-Next and Qwen3.5, as transformers defines it.

Each token is projected to q|k|v (through a short causal depthwise convolution with SiLU), z (the output's gate),
b (beta = sigmoid(b), how strongly the token writes) and a (the decay, g = -exp(A_log) * softplus(a + dt_bias)).
The gated delta rule (kernels/delta_rule.py) reads and writes one state per sequence; the output is RMS-normed per
value head, multiplied by SiLU(z), and projected back. On the CPU a step's decode rows, from the projections' output
to out_proj's input, are one call of our C kernel (cpu_deltanet.c), which the one-call step calls too.

A sequence's state lives outside the paged cache: conv_state [slots, conv_dim, kernel - 1] (the last inputs of the
convolution) and delta_state [slots, value_heads, key_dim, value_dim], both fp32, bound by the model runner; the
step's metadata says each decode row's and each prompt chunk's slot (AttentionMetadata.states). A row at a
sequence's first position starts from zeros, whatever its slot held before. A run that verifies drafts keeps the
state it started from until the model runner commits the accepted rows (commit): rejected drafts leave no trace.

Weights: Qwen3.5 projects q|k|v, z, b and a apart (in_proj_qkv, in_proj_z, in_proj_b, in_proj_a, fused on load
into in_proj_qkvz and in_proj_ba); Qwen3-Next projects them together grouped by key head (each key head's q, k,
then its value heads' v and z; its value heads' b, then a), reordered here after the product.
"""

import ctypes

import torch
import torch.nn.functional as F
from torch import nn

from backend.kernels import delta_rule, native
from backend.kernels.attention import AttentionMetadata
from backend.layer_spec import AttentionSpec
from backend.model_config import ModelConfig
from backend.quant.modules import QuantLinear, outputs_of


class DeltaNetWeights(ctypes.Structure):
    """cpu_exports.h's DeltaNet: what cpu_deltanet.c reads of a layer (GatedDeltaNet.c_weights)."""

    _fields_ = [(name, ctypes.c_void_p) for name in ("conv_weight", "dt_bias", "a_log", "norm", "conv_state",
                                                     "delta_state")]
    _fields_ += [(name, ctypes.c_int64) for name in ("hk", "hv", "dk", "dv", "kernel", "grouped", "tiled")]
    _fields_ += [("eps", ctypes.c_float)]


class GatedDeltaNet(nn.Module):
    def __init__(self, cfg: ModelConfig, spec: AttentionSpec):
        super().__init__()
        shape = spec.linear
        self.num_k_heads, self.num_v_heads = shape.num_key_heads, shape.num_value_heads
        self.k_dim, self.v_dim = shape.key_head_dim, shape.value_head_dim
        self.key_size, self.value_size = self.num_k_heads * self.k_dim, self.num_v_heads * self.v_dim
        self.conv_dim = 2 * self.key_size + self.value_size
        self.grouped, self.tiled = shape.grouped_projections, shape.tiled_value_heads
        self.eps = cfg.rms_norm_eps
        self.in_proj_qkvz = nn.Linear(cfg.hidden_size, self.conv_dim + self.value_size, bias=False)
        self.in_proj_ba = nn.Linear(cfg.hidden_size, 2 * self.num_v_heads, bias=False)
        self.conv1d = nn.Conv1d(
            self.conv_dim, self.conv_dim, shape.conv_kernel, groups=self.conv_dim, bias=False
        )
        self.dt_bias = nn.Parameter(torch.ones(self.num_v_heads))
        self.A_log = nn.Parameter(torch.zeros(self.num_v_heads))
        self.norm = nn.Module()
        self.norm.weight = nn.Parameter(torch.ones(self.v_dim))
        self.out_proj = nn.Linear(self.value_size, cfg.hidden_size, bias=False)
        # The paged cache this kind keeps none of (AttentionSpec.block_shapes), and the state pool's tensors: both
        # bound by the model runner.
        self.k_cache = self.v_cache = torch.empty(0)
        self.conv_state = torch.empty(0)
        self.delta_state = torch.empty(0)
        # the last forward's runs that verify drafts: (slot, its conv and delta states before, its rows' inputs)
        self.pending: list[tuple] = []

    def state_shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """One sequence's conv state and delta-rule state (fp32)."""
        return (self.conv_dim, self.conv1d.kernel_size[0] - 1), (self.num_v_heads, self.k_dim, self.v_dim)

    def _ungroup(self, qkvz: torch.Tensor, ba: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Qwen3-Next's per-key-head layout as q|k|v|z and b|a."""
        t, per = qkvz.shape[0], self.num_v_heads // self.num_k_heads
        grouped = qkvz.view(t, self.num_k_heads, -1)
        q, k, v, z = grouped.split([self.k_dim, self.k_dim, per * self.v_dim, per * self.v_dim], dim=-1)
        b, a = ba.view(t, self.num_k_heads, 2 * per).split([per, per], dim=-1)
        return (
            torch.cat([x.reshape(t, -1) for x in (q, k, v, z)], dim=-1),
            torch.cat([b.reshape(t, -1), a.reshape(t, -1)], dim=-1),
        )

    def forward(self, x: torch.Tensor, rope, meta: AttentionMetadata) -> torch.Tensor:
        qkvz, ba = self._projections(x)
        out = torch.empty(x.shape[0], self.value_size, dtype=torch.float32, device=x.device)
        n, states, self.pending = meta.num_decode, meta.states, []
        if n:
            out[:n] = self._rows(qkvz[:n], ba[:n], states.slots[:n], meta.decode_context_lens == 1)
        for j, chunk in enumerate(meta.prefills):
            rows, slot = slice(chunk.start, chunk.end), states.slots[n + j : n + j + 1]
            if states.drafts and states.drafts[j]:
                out[rows] = self._verify(qkvz[rows], ba[rows], slot)
            else:
                fresh = chunk.context_len == chunk.end - chunk.start
                out[rows] = self._prefill(qkvz[rows], ba[rows], slot, fresh)
        return self.out_proj(out.to(x.dtype))

    def _projections(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """in_proj_qkvz(x) and in_proj_ba(x); quantized, in one call (x quantized once for both, not once a part)."""
        if isinstance(self.in_proj_qkvz, QuantLinear) and isinstance(self.in_proj_ba, QuantLinear):
            qkvz, ba = outputs_of([self.in_proj_qkvz, self.in_proj_ba], x)
            return qkvz, ba
        return self.in_proj_qkvz(x), self.in_proj_ba(x)

    def _inputs(self, qkvz: torch.Tensor, ba: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The rule's inputs of projected rows: q|k|v before the convolution, z, g and beta (fp32)."""
        if self.grouped:
            qkvz, ba = self._ungroup(qkvz, ba)
        beta = ba[:, : self.num_v_heads].float().sigmoid()
        g = -self.A_log.float().exp() * F.softplus(ba[:, self.num_v_heads :].float() + self.dt_bias.float())
        z = qkvz[:, self.conv_dim :].reshape(-1, self.num_v_heads, self.v_dim)
        return qkvz[:, : self.conv_dim], z, g, beta

    def _split(self, mixed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        t = mixed.shape[0]
        q, k, v = mixed.split([self.key_size, self.key_size, self.value_size], dim=-1)
        return (
            q.reshape(t, self.num_k_heads, self.k_dim),
            k.reshape(t, self.num_k_heads, self.k_dim),
            v.reshape(t, self.num_v_heads, self.v_dim),
        )

    def c_weights(self) -> DeltaNetWeights | None:
        """What cpu_deltanet.c reads of this layer, the state pool as bound now; None where our C kernels do not
        take its tensors (not fp32 on the CPU, or no kernels)."""
        held = (self.conv1d.weight, self.dt_bias, self.A_log, self.norm.weight, self.conv_state, self.delta_state)
        if not native.usable(*held) or not all(t.is_contiguous() for t in held) or not self.conv_state.numel():
            return None
        return DeltaNetWeights(*(t.data_ptr() for t in held), self.num_k_heads, self.num_v_heads, self.k_dim,
                               self.v_dim, self.conv1d.kernel_size[0], int(self.grouped), int(self.tiled), self.eps)

    def _rows(self, qkvz, ba, slots: torch.Tensor, fresh: torch.Tensor) -> torch.Tensor:
        """Decode rows, each one token of its own sequence from its slot's states (zeros where fresh): their
        outputs before out_proj [rows, value_size] fp32. cpu_deltanet.c where it takes them (the one-call step
        calls it too: the same bits), else torch's ops."""
        weights = self.c_weights() if native.usable(qkvz, ba) and qkvz.stride(1) == ba.stride(1) == 1 else None
        if weights is not None:
            out = torch.empty(qkvz.shape[0], self.value_size)
            slots, fresh = slots.contiguous(), fresh.to(torch.uint8).contiguous()
            if not native.library().deltanet_rows(
                ctypes.byref(weights), qkvz.data_ptr(), qkvz.stride(0), ba.data_ptr(), ba.stride(0), qkvz.shape[0],
                slots.data_ptr(), fresh.data_ptr(), out.data_ptr(), torch.get_num_threads()
            ):
                raise MemoryError(f"no memory for {qkvz.shape[0]} linear-attention rows: lower --max-num-seqs")
            return out
        mixed, z, g, beta = self._inputs(qkvz, ba)
        conv = self.conv_state.index_select(0, slots)
        conv = torch.where(fresh[:, None, None], 0.0, conv)
        window = torch.cat([conv, mixed.float()[:, :, None]], dim=-1)  # [n, conv_dim, kernel]
        self.conv_state.index_copy_(0, slots, window[:, :, 1:])
        mixed = F.silu((window * self.conv1d.weight[:, 0].float()).sum(-1))
        core = delta_rule.recurrent_in_pool(*self._split(mixed), g, beta, self.delta_state, slots, fresh, self.tiled)
        return self._gated_norm(core, z)

    def _verify(self, qkvz, ba, slot: torch.Tensor) -> torch.Tensor:
        """A run that verifies drafts: each row computed as a decode row (the same arithmetic, so that greedy
        speculation keeps plain decoding's tokens), the state before the run kept for commit."""
        self.pending.append((slot, self.conv_state[slot].clone(), self.delta_state[slot].clone(), qkvz, ba))
        resumes = torch.zeros(1, dtype=torch.bool, device=qkvz.device)
        return torch.cat([self._rows(qkvz[i : i + 1], ba[i : i + 1], slot, resumes) for i in range(qkvz.shape[0])])

    def commit(self, kept: list[int]) -> None:
        """Each verifying run of the last forward keeps the state after its first kept[i] rows (its last known
        token and the accepted drafts): where a draft was rejected, the state before the run comes back and the
        accepted rows run again (cheaper than keeping every row's state: a few of these layers' decode rows)."""
        resumes = torch.zeros(1, dtype=torch.bool, device=self.delta_state.device)
        for (slot, conv, delta, qkvz, ba), n in zip(self.pending, kept, strict=True):
            if n == qkvz.shape[0]:
                continue
            self.conv_state.index_copy_(0, slot, conv)
            self.delta_state.index_copy_(0, slot, delta)
            for i in range(n):
                self._rows(qkvz[i : i + 1], ba[i : i + 1], slot, resumes)
        self.pending = []

    def _prefill(self, qkvz, ba, slot: torch.Tensor, fresh: bool) -> torch.Tensor:
        """A run of one sequence's tokens from its slot's state (zeros when the run starts the sequence): their
        outputs before out_proj [run, value_size] fp32."""
        mixed, z, g, beta = self._inputs(qkvz, ba)
        run, kernel = mixed.shape[0], self.conv1d.kernel_size[0]
        before = (
            mixed.new_zeros(kernel - 1, self.conv_dim, dtype=torch.float32)
            if fresh
            else self.conv_state[slot][0].t()
        )
        # [kernel - 1 + run, conv_dim]: the tokens in rows, as they come
        window = torch.cat([before, mixed.float()])
        self.conv_state.index_copy_(0, slot, window[None, run:].transpose(1, 2))
        # the depthwise convolution as a sum of shifted rows: the rows stay in place (the same sums as conv1d's,
        # which wants the tokens in columns: two transposed copies of the run)
        weight = self.conv1d.weight[:, 0].float()
        mixed = window[:run] * weight[:, 0]
        for j in range(1, kernel):
            mixed.addcmul_(window[j : j + run], weight[:, j])
        mixed = F.silu(mixed, inplace=True)
        core = delta_rule.recurrent_in_pool(
            *self._split(mixed), g, beta, self.delta_state, slot, torch.tensor([fresh]), self.tiled, run=True
        )
        return self._gated_norm(core, z)

    def _gated_norm(self, core: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """RMS norm over each value head, scaled by the weight, times SiLU(z); [t, value_size]."""
        normed = core * torch.rsqrt(core.pow(2).mean(-1, keepdim=True) + self.eps)
        out = (self.norm.weight * normed.to(self.norm.weight.dtype)).float() * F.silu(z.float())
        return out.reshape(core.shape[0], self.value_size)
