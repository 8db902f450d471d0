"""The spread of the gaps between a stream's tokens, as the load benches report it."""


def percentiles(gaps: list[float], name: str = "{}") -> dict:
    """The p50, p99 and max of gaps (seconds, to the millisecond), keyed name.format("p50") and so on, and how
    many gaps there were."""
    ordered = sorted(gaps) or [0.0]
    return {
        name.format("p50"): round(ordered[len(ordered) // 2], 3),
        name.format("p99"): round(ordered[int(len(ordered) * 0.99)], 3),
        name.format("max"): round(ordered[-1], 3),
        "gaps": len(gaps),
    }
