"""An fp32 engine's quantized matmuls with x in three 8-bit digits (cpu_layout's "digits", cpu_int8_rows.c): the
8-bit kernel's exact integer sums, x taken to 24 bits of each group's largest value. Oracles: gguf-py's dequantized
weights times x itself (float64), element by element through an identity matrix, and the fp32 kernel's own
rounding on the same weights."""

import dataclasses

import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf.quants import quantize

from backend.kernels import native
from backend.quant import cpu_layout
from backend.quant.formats import BY_NAME
from tests.backend.conftest import use_kernel_build
from tests.backend.quant_blocks import gguf_dequant
from tests.backend.test_cpu_int8 import FORMATS, quad_ordered

pytestmark = pytest.mark.skipif(native.library() is None, reason="no C compiler for the CPU kernels")


def digit_ordered(name: str, rows: int, cols: int, seed: int, raw=None):
    raw, quads = quad_ordered(name, rows, cols, seed, raw)
    return raw, (*quads[:3], dataclasses.replace(quads[3], order="digits"))


def hard_x(rows: int, cols: int, seed: int) -> torch.Tensor:
    """Random rows, one spanning six decades inside each group, one of zeros and a zero group, and one whose
    values sit where the digits carry (x * 127 / max |x| a hair under c + 1/2, and at exact halves)."""
    x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed))
    x[1] *= torch.logspace(-4, 2, cols)
    x[2] = 0.0
    x[3, 32:64] = 0.0
    steps = torch.arange(cols) % 120 - 60
    x[4] = (steps + torch.where(steps % 2 == 0, 0.4999, 0.5)) / 127.0
    x[4, ::32] = 1.0  # each group's max |x|: one step of 1/127
    return x


@pytest.mark.parametrize("name", FORMATS)
def test_digits_products_are_as_exact_as_fp32_products(name):
    """Every format, against x @ w.T in float64: no further off than the fp32 kernel's products on the same
    weights (its sums' rounding, the same size), and within 24 bits of each group's max |x| plus fp32 sums'
    rounding; a row's bits the same whatever the rows beside it (1 to 40 rows: tiles of one row, of two, more)."""
    cols, rows = 512, 101
    raw, digits = digit_ordered(name, rows, cols, seed=11)
    x = hard_x(40, cols, seed=1)
    w = gguf_dequant(raw, name).double()
    exact = x.double() @ w.T
    ours = cpu_layout.matmul(x, *digits, rows)
    panels = cpu_layout.pack(torch.from_numpy(raw), BY_NAME[name], cols)
    fp32 = cpu_layout.matmul(x, *panels, rows)
    scale = x.double().abs() @ w.abs().T + 1e-30
    ours_err, fp32_err = ((ours.double() - exact).abs() / scale).max(), ((fp32.double() - exact).abs() / scale).max()
    assert ours_err < 2 * fp32_err + 1e-8, (ours_err, fp32_err)
    group = digits[3].group
    amax = x.view(40, -1, group).abs().amax(-1).double()
    bound = amax @ w.abs().view(rows, -1, group).sum(-1).T * 2.0**-21 + scale * 2.0**-21
    assert ((ours.double() - exact).abs() <= bound).all()
    assert torch.equal(ours[2], torch.zeros(rows))
    for m in (1, 2, 3, 5, 8, 9, 17, 33):
        assert torch.equal(cpu_layout.matmul(x[:m], *digits, rows), ours[:m]), m
        assert torch.equal(cpu_layout.matmul(x[40 - m:], *digits, rows), ours[40 - m:]), m


def test_each_x_is_taken_to_24_bits_of_its_groups_max():
    """Through an identity matrix (Q8_0, every diagonal code 127) y is each x as the digits hold it: within 2^-22 of
    its group's max |x| (fp32's own spacing there is 2^-23 .. 2^-24), the carries (a remainder of a hair under a
    half, and exact halves) included; one digit (activations="int8") is 2^-8 off."""
    cols = 256
    raw = quantize(torch.eye(cols).numpy(), T.Q8_0)
    _, digits = digit_ordered("Q8_0", cols, cols, 0, raw)
    quads = (*digits[:3], dataclasses.replace(digits[3], order="quads"))
    w = gguf_dequant(raw, "Q8_0").double().diagonal()
    x = hard_x(8, cols, seed=2)
    amax = x.view(8, -1, 32).abs().amax(-1).repeat_interleave(32, dim=1).double()
    err = ((cpu_layout.matmul(x, *digits, cols).double() / w - x.double()).abs() / (amax + 1e-30))
    assert err.max() < 2.0**-22, err.max()
    int8_err = (cpu_layout.matmul(x, *quads, cols).double() / w - x.double()).abs() / (amax + 1e-30)
    assert int8_err.max() > 2.0**-9


@pytest.mark.parametrize("build", ["avx2", "avx_vnni", "portable"])
@pytest.mark.parametrize("name", ["Q4_K", "Q8_0", "Q6_K", "Q5_1", "Q8_0 with -128", "IQ4_XS", "MXFP4"])
def test_digits_are_the_same_bits_in_every_build(name, build, monkeypatch):
    """The native build's digits and sums (AVX-512 VNNI here) against AVX2's two-step products, AVX-VNNI's 8 lanes
    and GCC's portable vectors, which compute each digit element by element: the same bits, at 1 to 20 rows."""
    raw = None
    if name == "Q8_0 with -128":
        name, raw = "Q8_0", quantize(torch.randn(70, 256, generator=torch.Generator().manual_seed(4)).numpy(), T.Q8_0)
        raw[5, 2 + 7] = 0x80  # q = -128
    raw, digits = digit_ordered(name, 70, 256, seed=21, raw=raw)
    x = hard_x(20, 256, seed=22)
    native_y = [cpu_layout.matmul(x[:m], *digits, 70) for m in (1, 3, 20)]
    use_kernel_build(build, monkeypatch)
    for m, y in zip((1, 3, 20), native_y):
        assert torch.equal(cpu_layout.matmul(x[:m], *digits, 70), y), m


def test_digits_of_tiny_activations_and_nan():
    """Rows far below 1 keep their 24 bits (scaled by 2^64 first, as one digit's are) while a group's step, max |x|
    / 127, is a normal float (above 1.5e-36); below, the step's own denormal spacing limits them (1e-37: 2e-5 off,
    measured), where no model's activations go. A NaN or an infinity makes its row NaN, the others unharmed."""
    raw, digits = digit_ordered("Q4_K", 64, 256, seed=5)
    scales = torch.tensor([[1e-20], [1e-30], [1e-37]])
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(6)) * scales
    w = gguf_dequant(raw, "Q4_K").double()
    want = x.double() @ w.T
    err = (cpu_layout.matmul(x, *digits, 64).double() - want).abs().amax(1)
    assert (err < torch.tensor([1e-6, 1e-6, 1e-4], dtype=torch.float64) * want.abs().amax(1)).all(), err
    clean = cpu_layout.matmul(x, *digits, 64)
    x[0, 5], x[2, 40] = float("nan"), float("inf")
    y = cpu_layout.matmul(x, *digits, 64)
    assert y[0].isnan().all() and y[2].isnan().all() and torch.equal(y[1], clean[1])
