"""Compute kernels. Each has a torch reference (the CPU path and the test oracle) and, where it pays, a
Triton kernel for CUDA in triton_kernels.py.

SCRIPTORIUM_TRITON=1 sends CPU tensors through the Triton kernels too; with TRITON_INTERPRET=1 that
runs the CUDA path's kernels on the CPU, slowly but exactly, which is how the tests check it.
"""

import os

import torch


def use_triton(t: torch.Tensor) -> bool:
    return t.is_cuda or os.environ.get("SCRIPTORIUM_TRITON") == "1"
