"""Speculative decoding: proposers (n-gram lookup, a draft model) and lossless verification."""
