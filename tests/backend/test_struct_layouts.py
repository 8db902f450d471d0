"""The structs the one-call decode step and the MoE call read (backend/csrc/cpu_exports.h) and their ctypes mirrors
(cpu_decoder.py, cpu_parts.py, experts.py) have the same sizes and field offsets: a field added on one side only would make C
read the wrong pointers."""

import ctypes

import pytest

from backend.kernels import native
from backend.models import cpu_decoder
from backend.models.gated_deltanet import DeltaNetWeights
from backend.quant.cpu_parts import QuantMatrix
from backend.quant.experts import ExpertStack

pytestmark = pytest.mark.skipif(native.library() is None, reason="no C compiler for the CPU kernels")


def test_the_ctypes_mirrors_have_the_c_layouts():
    want = [ctypes.sizeof(QuantMatrix), ctypes.sizeof(cpu_decoder._Linear),
            cpu_decoder._Linear.bias.offset, ctypes.sizeof(ExpertStack), ExpertStack.order.offset,
            ctypes.sizeof(cpu_decoder._Experts), cpu_decoder._Experts.gate.offset,
            cpu_decoder._Experts.shared_gate.offset, cpu_decoder._Experts.shared_inter.offset,
            ctypes.sizeof(cpu_decoder._Layer), cpu_decoder._Layer.moe.offset, cpu_decoder._Layer.k_cache.offset,
            cpu_decoder._Layer.window.offset, ctypes.sizeof(cpu_decoder._Shape), cpu_decoder._Shape.eps.offset, cpu_decoder._Shape.final_norm.offset,
            cpu_decoder._Shape.kv_kind.offset, cpu_decoder._Layer.mla.offset, ctypes.sizeof(cpu_decoder._Latent),
            cpu_decoder._Latent.kv_a.offset, cpu_decoder._Latent.lora.offset, cpu_decoder._Latent.eps.offset,
            cpu_decoder._Layer.pre_ff_norm.offset, cpu_decoder._Layer.rope_offset.offset,
            cpu_decoder._Shape.gelu.offset, ctypes.sizeof(DeltaNetWeights), DeltaNetWeights.hk.offset,
            DeltaNetWeights.eps.offset, cpu_decoder._Layer.linear.offset, cpu_decoder._Layer.ba.offset,
            cpu_decoder._Shape.rotary_dim.offset, cpu_decoder._Shape.attn_width.offset,
            cpu_decoder._Experts.router_bias.offset, cpu_decoder._Experts.limit.offset, cpu_decoder._Layer.sinks.offset]
    got = (ctypes.c_int64 * len(want))()
    native.library().struct_layouts(got)
    assert list(got) == want
