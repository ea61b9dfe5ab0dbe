"""Numbers for people, shared by both front ends (the TUI and headless) without either importing
the other; pure, no I/O."""

from __future__ import annotations


def human_duration(seconds: float) -> str:
    """A rough duration for people: '40 s', '3 min', '1 h 20 min'."""
    if seconds < 60:
        return f"{max(seconds, 1):.0f} s"
    minutes = round(seconds / 60)
    return f"{minutes} min" if minutes < 60 else f"{minutes // 60} h {minutes % 60} min"
