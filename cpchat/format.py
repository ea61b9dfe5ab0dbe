"""Numbers for people, shared by both front ends (the TUI and headless) without either importing
the other; pure, no I/O."""

from __future__ import annotations

import re

UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def parse_size(text: str) -> int:
    """'8G', '512M', '1.5G', '1000000' (bytes) -> bytes."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)i?B?\s*", text, re.IGNORECASE)
    if not match:
        raise ValueError(f"not a size: {text!r} (expected bytes, or a number with K, M, G or T)")
    return int(float(match[1]) * UNITS[match[2].upper()])


def human_duration(seconds: float) -> str:
    """A rough duration for people: '40 s', '3 min', '1 h 20 min'."""
    if seconds < 60:
        return f"{max(seconds, 1):.0f} s"
    minutes = round(seconds / 60)
    return f"{minutes} min" if minutes < 60 else f"{minutes // 60} h {minutes % 60} min"


def human_bytes(n: float) -> str:
    """1536 -> '1.5 KiB'; whole numbers below 10 units keep one decimal."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            if unit == "B":
                return f"{int(n)} B"
            return f"{n:.1f} {unit}" if abs(n) < 10 else f"{n:.0f} {unit}"
        n /= 1024
    return f"{n:.0f} TiB"


def human_params(n: int) -> str:
    """A model's parameter count as model cards write it: 135M, 3.4M, 8.0B ('?' for 0: not known)."""
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.1f}{unit}" if n < 10 * size else f"{n / size:.0f}{unit}"
    return str(n) if n else "?"
