"""Quantized weights kept in their GGUF block form from the file to the matmul (see formats.py)."""
