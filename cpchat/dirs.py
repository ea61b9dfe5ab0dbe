"""The user's directories for cpchat (XDG): configuration, data (transcripts) and caches (converted
and downloaded models). The front end and the ranks both use them; a rank uses its own machine's."""

from __future__ import annotations

import os
from pathlib import Path


def new_user(home: Path) -> dict[str, str]:
    """The XDG variables of a user under `home` who never ran cpchat: no settings, transcripts or
    caches yet (for a screenshot or a test that must not see what an earlier run saved)."""
    return {"XDG_CONFIG_HOME": str(home / "config"), "XDG_DATA_HOME": str(home / "data"),
            "XDG_CACHE_HOME": str(home / "cache")}


def config_dir() -> Path:
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "cpchat"


def data_dir() -> Path:
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "cpchat"


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "cpchat"


def measure_dir() -> Path:
    """Where ranks on this machine keep their models' measured costs (cpchat.rank.measures)."""
    return cache_dir() / "measures"


PREFIX_CACHE_GB = 16.0  # the default bound on each rank's saved prefixes


def prefix_dir() -> Path:
    """Where ranks on this machine save prefixes: $CPCHAT_CACHE_DIR, or under the cache dir."""
    return Path(os.environ.get("CPCHAT_CACHE_DIR") or cache_dir() / "prefix").expanduser()
