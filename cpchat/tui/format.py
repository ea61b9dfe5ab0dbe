"""Small, pure formatting helpers shared by the panels."""

from __future__ import annotations


def human_count(n: int) -> str:
    """12345 -> '12.3k' so that rank rows stay narrow."""
    if n < 10_000:
        return str(n)
    if n < 1_000_000:
        return f"{n / 1000:.1f}k"
    return f"{n / 1_000_000:.2f}M"


def bar(fraction: float, width: int) -> str:
    """A left-aligned bar of eighth-blocks, `width` cells wide."""
    fraction = min(max(fraction, 0.0), 1.0)
    eighths = round(fraction * width * 8)
    full, part = divmod(eighths, 8)
    text = "█" * full + ("▏▎▍▌▋▊▉"[part - 1] if part else "")
    return text.ljust(width)
