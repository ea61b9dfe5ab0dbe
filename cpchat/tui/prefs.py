"""What the TUI remembers between runs that is not a setting: whether the side panels are shown.

"auto" shows them on wide terminals and collapses them to the status strip on narrow ones; "shown"
and "hidden" are the user's choice (Ctrl+B), kept at every width.
"""

from __future__ import annotations

import json
from pathlib import Path

PANELS = ("auto", "shown", "hidden")


def load_panels(path: Path) -> str:
    try:
        value = json.loads(path.read_text(encoding="utf-8")).get("panels")
    except (OSError, ValueError, AttributeError):
        return "auto"
    return value if value in PANELS else "auto"


def save_panels(path: Path, value: str) -> None:
    """Raises OSError when the file cannot be written."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"panels": value}) + "\n", encoding="utf-8")
