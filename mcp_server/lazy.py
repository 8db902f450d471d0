"""Modules imported on first use: `python -m mcp_server` must answer `initialize` soon after it starts
(agents time their servers' start-up), and the orchestrator's pipelines are needed only once a tool runs."""

import importlib.util
import sys
from types import ModuleType


def lazy(name: str) -> ModuleType:
    """The module `name`, executed when one of its attributes is first read (importlib's LazyLoader)."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.find_spec(name)
    if spec is None or spec.loader is None:
        raise ImportError(f"no module named {name!r}")
    loader = importlib.util.LazyLoader(spec.loader)
    spec.loader = loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    loader.exec_module(module)
    return module
