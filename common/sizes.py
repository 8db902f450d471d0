"""The memory-size grammar compose.yaml's x-ops gpu_memory and the backend's --gpu-memory-utilization share:
a fraction of the card (0.45) or a size (18GiB, 512MiB, 20GB, 19327352832)."""

import re

UNITS = {"b": 1, "k": 10**3, "kb": 10**3, "kib": 2**10, "m": 10**6, "mb": 10**6, "mib": 2**20, "g": 10**9,
         "gb": 10**9, "gib": 2**30, "t": 10**12, "tb": 10**12, "tib": 2**40}
_SIZE = re.compile(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*")


class SizeError(ValueError):
    pass


def parse_memory(value) -> int | float:
    """A float in [0, 1] (or text without a unit up to 1): a fraction of the card; else bytes (an int)."""
    if isinstance(value, bool):
        raise SizeError(f"{value!r} is not a memory amount")
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        if not 0 <= value <= 1:
            raise SizeError(f"a fraction of the card must be in [0, 1], got {value}")
        return value
    m = _SIZE.fullmatch(str(value))
    if not m:
        raise SizeError(f"{value!r} is not a size such as 18GiB, 512MiB or 20GB, nor a fraction of the card such "
                        "as 0.45")
    number, unit = float(m.group(1)), m.group(2).lower()
    if unit and unit not in UNITS:
        raise SizeError(f"unknown unit {m.group(2)!r} in {value!r}; use B, KiB, MiB, GiB, TiB (or kB, MB, GB)")
    if not unit and number <= 1:
        return number
    if not unit and not number.is_integer():
        raise SizeError(f"{value!r}: a fraction of the card is at most 1; a size takes a unit, such as 18GiB")
    return int(number * UNITS[unit or "b"])


def in_bytes(amount: int | float, total: int) -> int:
    """What a parsed amount comes to on a card of `total` bytes."""
    return int(amount * total) if isinstance(amount, float) else int(amount)
