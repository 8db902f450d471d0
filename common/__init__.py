"""Helpers every package shares (files, processes); imports nothing of ours."""
