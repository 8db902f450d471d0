"""EngineConfig's fields as command-line flags and as the fields of other dataclasses (EngineArgs): each setting's
name, type, default and help come from its one declaration in backend/config.py."""

import argparse
from dataclasses import Field, field, fields
from typing import Any

from backend.config import EngineConfig

_PLAIN = (int, float, str)


def flag_name(setting: Field) -> str:
    return setting.metadata.get("flag", "--" + setting.name.replace("_", "-"))


def _text_type(setting: Field) -> Any:
    """How the flag's text is read: the field's own `type` metadata, else its annotation (int, float or str,
    optionally | None)."""
    if "type" in setting.metadata:
        return setting.metadata["type"]
    kinds = [k for k in getattr(setting.type, "__args__", (setting.type,)) if k is not type(None)]
    if len(kinds) == 1 and kinds[0] in _PLAIN:
        return None if kinds[0] is str else kinds[0]
    raise TypeError(
        f"EngineConfig.{setting.name}: say how its flag's text is read, as setting(..., type=...) "
        f"(its annotation {setting.type} names no single int, float or str)"
    )


def flag_options(setting: Field) -> dict:
    """add_argument's keywords for one EngineConfig field."""
    options: dict[str, Any] = {
        "dest": setting.name,
        "default": setting.default,
        "help": setting.metadata.get("help"),
    }
    if setting.type is bool:
        # a setting that is on by default is switched off by its flag (--no-...)
        options["action"] = "store_false" if setting.default else "store_true"
        return options
    text_type = _text_type(setting)
    if text_type is not None:
        options["type"] = text_type
    if "choices" in setting.metadata:
        options["choices"] = setting.metadata["choices"]
    return options


def add_engine_arguments(
    parser: argparse.ArgumentParser, leave_out: tuple[str, ...] = (), changes: dict[str, dict] | None = None
) -> None:
    """A flag for each EngineConfig field but those in leave_out (which the front door declares itself);
    `changes` replaces some of a flag's add_argument keywords (serve's --gpu-memory-utilization also takes auto)."""
    for setting in fields(EngineConfig):
        if setting.name not in leave_out:
            options = {**flag_options(setting), **(changes or {}).get(setting.name, {})}
            parser.add_argument(flag_name(setting), **options)


def engine_settings(args: argparse.Namespace, leave_out: tuple[str, ...] = ()) -> dict:
    """EngineConfig's keywords from what add_engine_arguments added to args (leave_out as given to it)."""
    return {f.name: getattr(args, f.name) for f in fields(EngineConfig) if f.name not in leave_out}


def setting_help(name: str) -> str:
    return next(f.metadata["help"] for f in fields(EngineConfig) if f.name == name)


def engine_fields(leave_out: tuple[str, ...]) -> list[tuple[str, Any, Field]]:
    """EngineConfig's fields but leave_out, as make_dataclass takes them: (name, type, field with its default)."""
    return [
        (f.name, f.type, field(default=f.default, default_factory=f.default_factory, metadata=f.metadata))
        for f in fields(EngineConfig)
        if f.name not in leave_out
    ]
