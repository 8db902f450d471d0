"""How the text of a flag becomes a setting's value, for the settings that are not a plain int, float or str:
argparse `type=` functions, refusing bad text with a message that says what to write instead."""

import argparse

from common.sizes import parse_memory


def memory(text: str) -> float | int:
    """A fraction of the card (0.45) or a size (18GiB): the forms compose.yaml's x-ops gpu_memory takes, so ops
    passes its budget as written."""
    try:
        return parse_memory(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def memory_or_auto(text: str) -> float | int | str:
    return text if text == "auto" else memory(text)


def disk_size(text: str) -> int:
    size = memory(text)
    if isinstance(size, float):  # parse_memory reads a bare number up to 1 as a fraction of a card
        if size == 0:
            return 0
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a size; give bytes with a unit, such as 4GiB, or 0 (off)"
        )
    return size


def fraction_or_bytes(text: str) -> float | int:
    """A number: up to 1 a fraction, above it bytes (an int)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a number: give a fraction (0, 1] or bytes"
        ) from None
    return int(value) if value > 1 else value


def rope_scaling(text: str) -> dict | str:
    from backend.context_length import parse_rope_scaling

    try:
        return parse_rope_scaling(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def experts(text: str) -> int | str:
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a number of experts; give an integer >= 1 or 'auto'"
        ) from None
