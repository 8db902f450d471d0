"""Compute kernels. Each has a torch reference here (the CPU path and the test oracle)."""
