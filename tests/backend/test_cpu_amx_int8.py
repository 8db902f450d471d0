"""Rows of x in blocks of 16 on AMX tiles (cpu_amx_int8.c: a prompt chunk's or a large batch's rows, where the CPU
has the tiles): each row the bits cpu_int8.c's tiles give it alone, for every format in quad order, with one digit
(activations="int8") and three (an exact engine's "digits"), across whole blocks, the rows past them and a part panel.
On a CPU without the tiles the same rows take cpu_int8.c's tiles, and the test still holds (a row's bits never depend
on the rows beside it)."""

import dataclasses

import pytest
import torch

from backend.kernels import native
from backend.quant import cpu_layout
from tests.backend.quant_blocks import gguf_dequant
from tests.backend.test_cpu_int8 import FORMATS, quad_ordered, quantized_x

pytestmark = pytest.mark.skipif(native.library() is None, reason="no C compiler for the CPU kernels")


def test_the_tiles_run_where_the_cpu_has_them():
    """A build for a CPU with AMX's 8-bit tiles (Linux grants them on request) takes them: not silently VNNI alone."""
    flags = native._cpu_key().split()
    assert bool(native.library().int8_amx_usable()) == ("amx_int8" in flags and "amx_bf16" in flags)


@pytest.mark.parametrize("order", ["quads", "digits"])
@pytest.mark.parametrize("name", FORMATS)
def test_rows_in_blocks_of_16_have_each_rows_own_bits(name, order, monkeypatch):
    """53 rows (three blocks of 16 and 5 past them) by 309 weight rows (19 panels and a part; on 2 threads, enough
    panels for the tiles' tasks of two): every row equal to its own one-row matmul, bit for bit, and the whole within
    fp32's rounding of x as quantized times gguf-py's weights (one digit) or of x itself (three)."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)  # the threads the matmuls are given
    cols, rows = 512, 309
    raw, quads = quad_ordered(name, rows, cols, seed=31)
    layout = dataclasses.replace(quads[3], order=order)
    w_codes = (*quads[:3], layout)
    x = torch.randn(53, cols, generator=torch.Generator().manual_seed(32))
    x[20, :40] = 0.0  # a zero group inside a block
    ours = cpu_layout.matmul(x, *w_codes, rows)
    for m in range(53):
        assert torch.equal(cpu_layout.matmul(x[m : m + 1], *w_codes, rows), ours[m : m + 1]), m
    assert torch.equal(cpu_layout.matmul(x[16:48], *w_codes, rows), ours[16:48])  # two whole blocks, nothing past
    w = gguf_dequant(raw, name).double()
    want = (quantized_x(x, layout.group) if order == "quads" else x.double()) @ w.T
    assert (ours.double() - want).abs().max() < 2e-6 * want.abs().max()
