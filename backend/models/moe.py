"""The sparse feed-forward of Mixtral, Qwen2-MoE (with its gated shared expert), Qwen3-MoE, OLMoE and Granite-MoE
(with its ungated shared expert, in GraniteMoeShared)."""

import torch
import torch.nn.functional as F
from torch import nn

from backend.kernels.moe_torch import add_shared, fused_moe, route_groups, route_rows
from backend.layer_spec import MLPSpec
from backend.model_config import ModelConfig
from backend.models.mlp import MLP


class SparseMoE(nn.Module):
    def __init__(self, cfg: ModelConfig, spec: MLPSpec):
        super().__init__()
        self.router, self.spec = spec.router, spec
        e, i, h = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
        self.top_k = cfg.num_experts_per_tok
        self.renormalize = cfg.norm_topk_prob
        self.gate = nn.Linear(h, e, bias=spec.bias)
        # sigmoid_bias: added to the scores for the choice of experts only (DeepSeek-V3's e_score_correction_bias)
        self.e_score_correction_bias = nn.Parameter(torch.zeros(e)) if spec.router == "sigmoid_bias" else None
        # Experts stacked so a grouped kernel can address them by index: gate and up fused per expert.
        self.w_gate_up = nn.Parameter(torch.empty(e, 2 * i, h))
        self.w_down = nn.Parameter(torch.empty(e, h, i))
        # gpt-oss's: a bias on each expert's gate/up rows and on its down rows (None elsewhere)
        self.w_gate_up_bias = nn.Parameter(torch.empty(e, 2 * i)) if spec.bias else None
        self.w_down_bias = nn.Parameter(torch.empty(e, h)) if spec.bias else None
        self.experts = None  # a QuantExperts in place of w_gate_up/w_down when a GGUF keeps them quantized
        self.expert_cache = None  # set by offload(): experts in host memory, some resident
        self.shared_expert = self.shared_expert_gate = None
        if cfg.shared_expert_intermediate_size:
            self.shared_expert = MLP(h, cfg.shared_expert_intermediate_size, bias=False)
            self.shared_expert_gate = nn.Linear(h, 1, bias=False) if cfg.shared_expert_gated else None

    def use_quantized(self, experts: nn.Module) -> None:
        """Compute with these (backend.quant.experts.QuantExperts) instead of the float stacks (gpt-oss's biases
        stay this module's)."""
        del self.w_gate_up, self.w_down
        self.experts = experts

    def offload(self, slots: int, device: torch.device, cpu_compute: bool = False) -> None:
        """Keep `slots` experts on `device` and the rest in host memory: copied in when routed to (ExpertCache: as
        many slots rotate as one token routes to, so that any token's experts are on the device together), or
        with cpu_compute computed where they are (SplitExperts)."""
        self._only_plain_experts("offloaded")
        from backend.models.expert_cache import ExpertCache

        if cpu_compute:
            self.expert_cache = self._split(slots, device)
            return
        if self.experts is not None:
            experts = self.experts
            self.expert_cache = ExpertCache(experts.tensors(), slots, self.top_k, device,
                                            lambda x, stacks, w, ids: experts(x, w, ids, stacks))
            experts.release()  # the module keeps the formats and shapes; module.to(device) moves nothing
            return
        self.expert_cache = ExpertCache([self.w_gate_up.data, self.w_down.data], slots, self.top_k, device,
                                        lambda x, stacks, w, ids: fused_moe(x, stacks[0], stacks[1], w, ids))
        del self.w_gate_up, self.w_down  # no longer parameters: module.to(device) must not move them

    def _only_plain_experts(self, what: str) -> None:
        if self.spec.bias or self.spec.clamped_swiglu:
            raise ValueError(f"experts with biases and the clamped SwiGLU (gpt-oss) cannot be {what} yet: load the "
                             "model with every expert on the device")

    def _split(self, slots: int, device: torch.device):
        from backend.models.split_experts import SplitExperts

        if self.experts is not None:
            experts = self.experts
            host = experts.host_part(min(slots, experts.num_experts))
            split = SplitExperts(experts.tensors(), slots, device, lambda x, stacks, w, ids: experts(x, w, ids, stacks),
                                 host, sum(t.numel() * t.element_size() for t in host.tensors()))
            experts.release()
            return split
        gate_up, down = (w.data[slots:].to("cpu", copy=True) for w in (self.w_gate_up, self.w_down))

        def host(x: torch.Tensor, w: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
            return fused_moe(x.to(gate_up.dtype), gate_up, down, w.to(gate_up.dtype), ids).float()

        split = SplitExperts([self.w_gate_up.data, self.w_down.data], slots, device,
                             lambda x, stacks, w, ids: fused_moe(x, stacks[0], stacks[1], w, ids), host,
                             gate_up.numel() * gate_up.element_size() + down.numel() * down.element_size())
        del self.w_gate_up, self.w_down
        return split

    def _apply(self, fn, recurse=True):
        module = super()._apply(fn, recurse)
        if self.expert_cache is not None:  # follow the module to its device, the host copies stay put
            probe = fn(torch.empty(0, device=self.expert_cache.device))
            if probe.device != self.expert_cache.device:
                self.expert_cache.to(probe.device)
        return module

    def _route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's experts and their weights (fp32), by this layer's router."""
        if self.router == "softmax_topk":
            weights, ids = route_rows(x, self.gate, self.top_k, self.renormalize)
        else:  # DeepSeek's and GLM's routers take fp32 logits
            bias = self.gate.bias.float() if self.gate.bias is not None else None
            logits = F.linear(x.float(), self.gate.weight.float(), bias)
            weights, ids = route_groups(logits, self.top_k, self.renormalize, self.router, self.spec.n_group,
                                        self.spec.topk_group, self.e_score_correction_bias)
        scale = self.spec.routed_scaling_factor
        return (weights, ids) if scale == 1.0 else (weights * scale, ids)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self._route(x)
        if self.expert_cache is not None:
            out = self.expert_cache.compute(x, weights.to(x.dtype), ids)
        elif self.experts is not None:
            biases = None if self.w_gate_up_bias is None else (self.w_gate_up_bias, self.w_down_bias)
            out = self.experts(x, weights.to(x.dtype), ids, biases=biases, clamped_swiglu=self.spec.clamped_swiglu)
        else:
            out = fused_moe(x, self.w_gate_up, self.w_down, weights, ids, self.w_gate_up_bias, self.w_down_bias,
                            self.spec.clamped_swiglu)
        if self.shared_expert_gate is not None:
            out = add_shared(out, x, self.shared_expert_gate, self.shared_expert(x))
        elif self.shared_expert is not None:  # Granite-MoE's, added as it is
            out = out + self.shared_expert(x)
        return out
