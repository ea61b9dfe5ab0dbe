"""What every benchmark writes into its --out folder: a Markdown report, the JSON of every figure beside
it, the command that made them and the machine they were measured on."""

from __future__ import annotations

import json
import os
import platform
import shlex
import sys
from pathlib import Path

import mlx.core as mx

from cpchat import blas


def command_line(argv: list[str] | None = None) -> str:
    """The command as typed, for the report."""
    if argv is None:
        argv = sys.argv[2:] if sys.argv[1:2] == ["bench"] else sys.argv[1:]
    return ("cpchat bench " + shlex.join(argv)).strip()


def machine() -> dict:
    """What the numbers were measured on."""
    return {"cpu": blas.cpu_name(), "cores": os.cpu_count(), "system": platform.system(),
            "python": platform.python_version(), "mlx": getattr(mx, "__version__", "")}


def write_report(out: Path, name: str, lines: list[str], data: dict) -> None:
    """`out`/NAME.md (the lines) and `out`/NAME.json (the data)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.md").write_text("\n".join(lines) + "\n")
    (out / f"{name}.json").write_text(json.dumps(data, indent=1))
