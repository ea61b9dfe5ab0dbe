"""`cpchat --print-config`: every setting, its value, and where the value came from."""

from __future__ import annotations

import argparse
import sys
from dataclasses import fields

from cpchat.client.settings import Settings, resolve_settings
from cpchat.dirs import config_dir, data_dir
from cpchat.errors import BadInput


def format_config(settings: Settings) -> str:
    names = [f.name for f in fields(Settings) if f.name != "sources"]
    width = max(len(n) for n in names)
    lines = [f"# config file: {config_dir() / 'config.toml'}", f"# transcripts: {data_dir() / 'transcripts'}"]
    for name in names:
        value = getattr(settings, name)
        shown = repr(value) if isinstance(value, str) else ("none" if value is None else str(value))
        if name == "model" and not value:
            shown = "'' (the built-in demo model)"
        lines.append(f"{name:<{width}} = {shown:<32} # {settings.sources.get(name, 'default')}")
    return "\n".join(lines)


def print_config(args: argparse.Namespace) -> int:
    try:
        settings = resolve_settings(args)
    except BadInput as e:
        print(f"cpchat: {e}", file=sys.stderr)
        return 2
    print(format_config(settings))
    return 0
