"""Compute kernels. Each has a torch reference (the CPU path and the test oracle) and, where it pays, a
Triton kernel for CUDA in triton_kernels.py.

SCRIPTORIUM_TRITON=1 sends CPU tensors through the Triton kernels too; with TRITON_INTERPRET=1 that
runs the CUDA path's kernels on the CPU, slowly but exactly, which is how the tests check it.
"""

import os

import torch


def use_triton(t: torch.Tensor) -> bool:
    if t.is_cuda:
        return True
    if os.environ.get("SCRIPTORIUM_TRITON") != "1":
        return False
    if os.environ.get("TRITON_INTERPRET") != "1":  # a compiled kernel would read CPU pointers as device memory
        raise RuntimeError("SCRIPTORIUM_TRITON=1 sends CPU tensors through the Triton kernels, which only "
                           "Triton's interpreter can run: set TRITON_INTERPRET=1 too, or unset SCRIPTORIUM_TRITON")
    return True
