"""How an engine is put together before its loop runs: the device it computes on, the arithmetic of its weights
and activations, the tokens that end a sequence, and speculation's proposer. The weights themselves load in
engine/residency.py (at start and after a deep sleep); LLMEngine.__init__ calls both and keeps what they return."""

import torch

from backend.arithmetic import pick_dtype, products
from backend.config import EngineConfig
from backend.engine.kv_budget import check_cuda_block_size
from backend.engine.state_pool import is_hybrid
from backend.kernels import native
from backend.model_config import ModelConfig
from backend.quant.weight_sizes import module_bytes
from backend.speculative.draft import DraftProposer
from backend.speculative.ngram import NgramProposer
from backend.speculative.speculative_config import SpeculativeConfig
from backend.speculative.speculator import Speculator


def pick_device(config: EngineConfig) -> torch.device:
    """The device asked for (else CUDA where PyTorch sees a GPU), refused where it cannot run."""
    device = torch.device(config.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' was asked for, but PyTorch sees no CUDA GPU; use device='cpu'")
    if device.type == "cuda":
        check_cuda_block_size(config.block_size)
    if device.type == "cpu":  # a first start's compile overlaps the tokenizer and the weights
        native.build_in_background()
    return device


def pick_arithmetic(config: EngineConfig, device: torch.device, model_config: ModelConfig,
                    reader) -> tuple[torch.dtype, str]:
    """(dtype of activations, products): the products' kind (backend.arithmetic.products) decides the dtype
    where it is bfloat16 on the CPU's tiles (fp32 activations around them)."""
    dtype = pick_dtype(config.dtype, device, model_config.torch_dtype)
    kind = products(dtype, device, reader, config.quantization, config.activations, config.model)
    return (torch.float32 if kind == "bfloat16" else dtype), kind


def end_tokens(model_config: ModelConfig, tokenizer) -> set[int]:
    """The config's end-of-sequence tokens and the tokenizer's own."""
    ids = set(model_config.eos_token_ids)
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(tokenizer.eos_token_id)
    return ids


def speculation(spec: SpeculativeConfig | None, draft_model, target, device: torch.device, dtype: torch.dtype,
                num_blocks: int, block_size: int, kv_dtype: torch.dtype, bridge, max_model_len: int):
    """(proposer, speculator): a draft model's (its KV cache of num_blocks) or n-gram lookup's, or (None, None)
    without speculation."""
    if spec is None:
        return None, None
    if draft_model is not None and is_hybrid(draft_model.config):
        raise ValueError(f"a draft model with linear-attention layers ({draft_model.config.architecture}) is not "
                         "supported: its state cannot follow the target's accepted drafts; use a transformer draft")
    if draft_model is not None:
        proposer = DraftProposer(draft_model, device, dtype, num_blocks, block_size, kv_dtype, bridge)
        # A decode step reads its weights once: the draft's cost relative to the target's is their bytes
        # (parameters would miss quantized weights, which are buffers of blocks).
        cost = module_bytes(draft_model) / module_bytes(target)
    else:
        proposer, cost = NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max), 0.0
    return proposer, Speculator(spec, proposer, cost, max_model_len)
