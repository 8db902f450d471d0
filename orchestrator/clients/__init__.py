"""Clients of the services the orchestrator drives: an OpenAI-compatible LLM server and ComfyUI."""
