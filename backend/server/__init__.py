"""The OpenAI-compatible HTTP server over the engine (python -m backend serve)."""
