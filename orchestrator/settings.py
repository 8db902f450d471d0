"""The project's settings live in common.settings (ops reads them too); this name stays for the orchestrator's
callers and users' scripts."""

from common.settings import DEFAULT_LLM_URL, ENV, Settings, SettingsError

__all__ = ["DEFAULT_LLM_URL", "ENV", "Settings", "SettingsError"]
