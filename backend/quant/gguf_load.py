"""A GGUF file's tensors into a CausalLM: quantized ones stay in their blocks, the rest load as floats.

A layer with any quantized tensor becomes a QuantLinear (q|k|v and gate|up keep one part per format);
quantized experts become QuantExperts; a quantized embedding is looked up row by row (and, tied, is
the output layer's weight too). Floats (norms, biases, F16/F32 weights, and any type gguf-py reads that no
kernel of ours takes, dequantized here by gguf-py) go through weights.load_weights under their Hugging Face names.
"""

import logging
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import groupby

import numpy as np
import torch

from backend.families import gpt_oss, qwen3_next
from backend.families.deepseek import kv_b_from_split
from backend.gguf_config import ROPE_PERMUTED
from backend.model_config import ModelLoadError
from backend.quant.formats import FLOAT_TYPES, FORMATS
from backend.quant.gguf_experts import expert_parts, quant_experts
from backend.quant.modules import QuantEmbedding, QuantLinear, QuantWeight
from backend.weights import load_weights, materialise

log = logging.getLogger("backend.quant")

_GLOBAL = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj", "ffn_gate_inp": "mlp.gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj", "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj", "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    # deepseek2's latent attention (attn_k_b and attn_v_b, the split kv_b, are joined at load) and the sigmoid
    # router's selection bias (deepseek2, glm4moe)
    "attn_q_a": "self_attn.q_a_proj", "attn_q_a_norm": "self_attn.q_a_layernorm", "attn_q_b": "self_attn.q_b_proj",
    "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa", "attn_kv_a_norm": "self_attn.kv_a_layernorm",
    "attn_kv_b": "self_attn.kv_b_proj", "attn_k_b": "self_attn.kv_b_proj", "attn_v_b": "self_attn.kv_b_proj",
    "exp_probs_b": "mlp.exp_probs_b",
}
_SPLIT_KV_B = ("attn_k_b", "attn_v_b")
# expanded to floats at load: the latent attention reads kv_b as a float matrix (attn_k_b transposed)
_FLOAT_KINDS = ("attn_kv_b", *_SPLIT_KV_B)
# phi3 stores q|k|v and gate|up fused, as our modules hold them (its ffn_up is gate rows, then up rows)
_LAYOUT_LAYER = {"phi3": {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},
                 # Gemma 3's sandwich: ffn_norm is the MLP's input norm, post_attention_norm the attention output's
                 "gemma3": {"post_attention_norm": "post_attention_layernorm", "ffn_norm": "pre_feedforward_layernorm",
                            "post_ffw_norm": "post_feedforward_layernorm"},
                 # GLM-4.5's norm before the MLP, under the name llama.cpp's glm4moe gives it
                 "glm4moe": {"post_attention_norm": "post_attention_layernorm"}, "gpt-oss": gpt_oss.GGUF_TENSORS}
# layouts whose converter stores each (1 + w) norm as 1 + w; our norms add the 1 themselves (in fp32, which a
# bf16 copy of 1 + w would round away)
_NORMS_PLUS_ONE = ("gemma3",)
_FUSED = {".q_proj": (".qkv_proj", 0), ".k_proj": (".qkv_proj", 1), ".v_proj": (".qkv_proj", 2),
          ".gate_proj": (".gate_up_proj", 0), ".up_proj": (".gate_up_proj", 1), **qwen3_next.FUSED}


@dataclass
class Entry:
    tensor: object  # gguf ReaderTensor
    name: str  # Hugging Face name (".weight"/".bias"), or the expert stack's module + role
    layer: int | None
    kind: str
    expert: int | None = None  # legacy per-expert tensors
    role: int | None = None  # expert stacks: 0 gate, 1 up, 2 down
    part: tuple[int, int] | None = None  # the rows it holds of a fused tensor (ffn_gate_up_exps)

    @property
    def fmt(self):
        return FORMATS.get(int(self.tensor.tensor_type))

    @property
    def rows_cols(self) -> tuple[int, int]:
        shape = [int(s) for s in self.tensor.shape]  # ggml order: cols first
        rows = shape[1] if len(shape) > 1 else 1
        return (rows if self.part is None else self.part[1] - self.part[0]), shape[0]


def entries(reader, source: str, arch: str) -> list[Entry]:
    out, layer_names = [], {**_LAYER, **_LAYOUT_LAYER.get(arch, {})}
    fields = reader.fields
    run = int(fields.get(f"{arch}.block_count", 0) or 0) - int(fields.get(f"{arch}.nextn_predict_layers", 0) or 0)
    for t in reader.tensors:
        parts = t.name.split(".")
        if parts[0] == "blk":
            # a tensor named without .weight (qwen3next's ssm_a) is its own kind and suffix
            layer, kind, suffix = int(parts[1]), ".".join(parts[2:-1]) or parts[-1], parts[-1]
            if layer >= run:
                continue  # glm4moe's multi-token prediction layers, which we do not run
        else:
            layer, kind, suffix = None, ".".join(parts[:-1]), parts[-1]
        if kind in ("rope_freqs", "rope_factors_long", "rope_factors_short"):
            continue  # read into the config's rope scaling (backend/gguf_config.py)
        prefix = f"model.layers.{layer}." if layer is not None else ""
        if stacks := expert_parts(t, kind, suffix, source):
            out += [Entry(t, f"{prefix}mlp", layer, kind, expert=x, role=r, part=p) for r, x, p in stacks]
        elif layer is not None and arch in qwen3_next.GGUF_LAYOUTS and (ours := qwen3_next.gguf_name(kind, suffix)):
            out.append(Entry(t, prefix + ours, layer, kind))
        elif (layer is None and kind in _GLOBAL) or (layer is not None and kind in layer_names):
            out.append(Entry(t, f"{prefix}{(_GLOBAL if layer is None else layer_names)[kind]}.{suffix}", layer, kind))
        else:
            raise ModelLoadError(f"{source}: GGUF tensor {t.name!r} is not one this layout uses; expected the "
                                 f"tensors of llama.cpp's {arch} layout")
    return out


def _is_module(model, name: str) -> bool:
    try:
        model.get_submodule(name)
    except AttributeError:
        return False
    return True


def _module_of(name: str) -> tuple[str, int]:
    """A linear layer's HF weight name -> (our module, its shard)."""
    module = name.rsplit(".", 1)[0]
    for theirs, (ours, shard) in _FUSED.items():
        if module.endswith(theirs):
            return module[: -len(theirs)] + ours, shard
    return module, 0


def _unpermute_rope(w: np.ndarray, num_heads: int) -> np.ndarray:
    # llama.cpp's converter reorders the rows of Llama q/k projections so each head's rotary pairs are
    # interleaved; undo it to get back the "rotate half" layout of Hugging Face checkpoints. Rows of
    # blocks move as rows of weights do.
    rows = w.shape[0]
    return w.reshape(num_heads, rows // num_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


class GGUFLoad:
    def __init__(self, model, reader, arch: str, dtype: torch.dtype, source: str, keep_quantized: bool):
        self.model, self.reader, self.arch, self.dtype, self.source = model, reader, arch, dtype, source
        self.cfg = model.config
        self.entries = entries(reader, source, arch)
        self.keep = keep_quantized
        self.dequantized: dict[str, tuple[int, int]] = {}  # types expanded at load -> (bytes in the file, weights)
        self.targets: dict[int, tuple[QuantWeight, int, int | None]] = {}  # id(tensor) -> (weight, row, expert)

    def quantized(self, e: Entry) -> bool:
        return self.keep and e.fmt is not None and e.name.split(".")[-1] != "bias" and e.kind not in _FLOAT_KINDS

    def array(self, e: Entry) -> np.ndarray:
        """The tensor as the file holds it: blocks for kernel formats we keep, else float32 weights."""
        t = e.tensor
        if self.quantized(e):
            data = np.asarray(t.data)
        else:
            from gguf.quants import dequantize

            # counted for the warning: not the kinds expanded by design; a fused tensor once (at its first part)
            if int(t.tensor_type) not in FLOAT_TYPES and e.kind not in _FLOAT_KINDS and not (e.part or (0,))[0]:
                file_bytes, elements = self.dequantized.get(t.tensor_type.name, (0, 0))
                self.dequantized[t.tensor_type.name] = (file_bytes + int(t.n_bytes), elements + int(t.n_elements))
            data = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
        if e.part is not None:  # gate's or up's rows of a fused stack
            data = np.ascontiguousarray(data[..., e.part[0] : e.part[1], :])
        if self.arch in ROPE_PERMUTED and e.kind in ("attn_q", "attn_k"):
            data = _unpermute_rope(data, self.cfg.num_heads if e.kind == "attn_q" else self.cfg.num_kv_heads)
        if self.arch in qwen3_next.GGUF_LAYOUTS:
            data = qwen3_next.gguf_array(e.kind, data, self.cfg, e.layer)
        return data

    # planning, on the meta model -------------------------------------------------------------------

    def plan(self) -> None:
        linear: dict[str, dict[int, Entry]] = {}
        experts: dict[str, dict[int, list[Entry]]] = {}
        for e in self.entries:
            if e.role is not None:
                experts.setdefault(e.name, {}).setdefault(e.role, []).append(e)
            elif e.name.endswith(".weight") and e.kind != "token_embd" and not e.kind.endswith("norm"):
                module, shard = _module_of(e.name)
                if not _is_module(self.model, module):  # latent attention's q_proj, not fused with k and v
                    module, shard = e.name.rsplit(".", 1)[0], 0
                linear.setdefault(module, {})[shard] = e
        for module, shards in linear.items():
            if any(self.quantized(e) for e in shards.values()):
                self._quant_linear(module, [shards[i] for i in sorted(shards)])
        for module, roles in experts.items():
            if any(self.quantized(e) for es in roles.values() for e in es):
                self._quant_experts(module, roles)
        embed = next(e for e in self.entries if e.kind == "token_embd")
        if self.quantized(embed):
            rows, cols = embed.rows_cols
            weight = QuantWeight(embed.fmt, rows, cols, dtype=self.dtype)
            self.targets[id(embed)] = (weight, 0, None)
            self.model.model.embed_tokens = QuantEmbedding(weight, self.dtype)
            if self.cfg.tie_word_embeddings:
                self.model.lm_head = QuantLinear(cols, [weight], bias=False, dtype=self.dtype)

    def _weight(self, es: list[Entry], lead: tuple[int, ...] = ()) -> QuantWeight:
        rows, cols = es[0].rows_cols
        fmt = es[0].fmt if self.quantized(es[0]) else None
        w = QuantWeight(fmt, sum(e.rows_cols[0] for e in es), cols, lead, dtype=self.dtype)
        row = 0
        for e in es:
            self.targets[id(e)] = (w, row, e.expert)
            row += e.rows_cols[0]
        return w

    def _quant_linear(self, module: str, shards: list[Entry]) -> None:
        # Adjacent shards of one format share a part (one kernel call).
        groups = groupby(shards, key=lambda e: e.fmt if self.quantized(e) else None)
        parts = [self._weight(list(g)) for _, g in groups]
        old = self.model.get_submodule(module)
        new = QuantLinear(shards[0].rows_cols[1], parts, bias=old.bias is not None, dtype=self.dtype)
        parent, _, attr = module.rpartition(".")
        setattr(self.model.get_submodule(parent) if parent else self.model, attr, new)

    def _quant_experts(self, module: str, roles: dict[int, list[Entry]]) -> None:
        experts = quant_experts(roles, self.quantized, self.dtype, self.source, module, self.targets)
        self.model.get_submodule(module).use_quantized(experts)

    # filling, once the model has memory --------------------------------------------------------------

    def fill(self) -> None:
        with torch.no_grad():
            load_weights(self.model, self._floats(), self.source)
        if self.dequantized:
            names = ", ".join(sorted(self.dequantized))
            file_bytes = sum(b for b, _ in self.dequantized.values())
            held = sum(n for _, n in self.dequantized.values()) * torch.empty(0, dtype=self.dtype).element_size()
            why = ("our kernels do not take %s; those tensors are" if self.keep
                   else "quantization=dequantize: %s tensors")
            (log.warning if self.keep else log.info)(
                "%s: " + why + " dequantized at load to %s: %.3f GiB in memory where the file holds %.3f GiB "
                "(%.3f GiB more)", self.source, names, str(self.dtype).removeprefix("torch."), held / 2**30,
                file_bytes / 2**30, (held - file_bytes) / 2**30)

    def _floats(self) -> Iterator[tuple[str, torch.Tensor]]:
        split: dict[int, dict[str, np.ndarray]] = {}  # a layer's attn_k_b and attn_v_b, until both are read
        for e in self.entries:
            target = self.targets.get(id(e))
            if target is not None:
                self._copy(e, *target)
                continue
            if e.kind in _SPLIT_KV_B:
                parts = split.setdefault(e.layer, {})
                parts[e.kind] = self.array(e)
                if len(parts) == 2:
                    yield e.name, torch.from_numpy(kv_b_from_split(parts["attn_k_b"], parts["attn_v_b"]))
                continue
            data = torch.from_numpy(self.array(e).copy())
            if self.arch in _NORMS_PLUS_ONE and e.kind.endswith("norm"):
                data -= 1.0
            if e.role is not None:  # float experts: the per-expert names weights.load_weights knows
                proj = ["gate_proj", "up_proj", "down_proj"][e.role]
                stack = data if e.expert is None else data[None]
                first = 0 if e.expert is None else e.expert
                for i in range(stack.shape[0]):
                    yield f"{e.name}.experts.{first + i}.{proj}.weight", stack[i]
            elif e.kind == "ffn_gate_inp_shexp":
                yield e.name, data.reshape(1, -1)
            else:
                yield e.name, data

    def _copy(self, e: Entry, w: QuantWeight, row: int, expert: int | None) -> None:
        data = self.array(e)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the file's memory map is read-only; copy_ only reads it
            src = torch.from_numpy(data)
        dest = w.data if expert is None else w.data[expert]
        rows = src.shape[-2] if src.dim() > 1 else 1
        dest = dest[..., row:row + rows, :]
        if tuple(dest.shape) != tuple(src.shape):
            raise ModelLoadError(f"{self.source}: tensor {e.tensor.name!r} has {tuple(src.shape)}, the model "
                                 f"expects {tuple(dest.shape)} from the file's metadata")
        if dest.shape == w.data.shape and dest.dtype == src.dtype and not data.flags.writeable:
            # A whole weight (an expert stack, most layers) is the file's own pages, mapped read-only and never
            # written: no copy in anonymous memory on the way to its repack, the device or the offloaded experts'
            # host memory (a 26 GB Mixtral is never held twice)
            w.data = src
            return
        dest.copy_(src)


def load_gguf(model, reader, dtype: torch.dtype, source: str, keep_quantized: bool = True) -> None:
    """Replace the meta model's layers that the file keeps quantized (every format of formats.py, on every device),
    allocate, then load every tensor."""
    arch = reader.fields["general.architecture"]
    loading = GGUFLoad(model, reader, arch, dtype, source, keep_quantized)
    loading.plan()
    materialise(model, "cpu")
    model.tie_weights()
    loading.fill()
