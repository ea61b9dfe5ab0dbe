"""Turn a bracketed paste into file paths, the way terminals deliver a file drop.

Terminals paste dropped files as their paths: plain, 'single' or "double"
quoted, with backslash-escaped spaces, or as file:// URIs (percent-encoded),
separated by spaces or newlines. A paste counts as a drop only when every
item names an existing file, or a folder written as a path (with a `/`: a
bare word that happens to name a folder is text); anything else is ordinary text.
"""

from __future__ import annotations

import os
import shlex
from pathlib import Path
from urllib.parse import unquote, urlparse


def split_paste(text: str) -> list[str] | None:
    """The paste's items, unquoted and unescaped; None where it is not shell-like.

    Pure: looks at no file. `file://` URIs become local paths.
    """
    text = text.strip()
    if not text or "\0" in text:
        return None
    items: list[str] = []
    for line in text.splitlines():
        line = line.strip()
        if not line:
            continue
        try:
            words = shlex.split(line, posix=True)
        except ValueError:  # an unmatched quote: prose, not paths
            return None
        items.extend(words)
    paths: list[str] = []
    for item in items:
        if item.startswith("file:"):
            uri = urlparse(item)
            if uri.scheme != "file" or uri.netloc not in ("", "localhost"):
                return None
            item = unquote(uri.path)
        paths.append(item)
    return paths or None


def parse_dropped_paths(text: str, cwd: Path | None = None) -> list[Path] | None:
    """The existing files and folders a paste names, or None when it is text to insert.

    A single path with unescaped spaces (some terminals paste it so) is tried
    as a whole before giving up.
    """
    base = cwd or Path.cwd()

    def existing(item: str) -> Path | None:
        path = Path(os.path.expanduser(item))
        path = path if path.is_absolute() else base / path
        return path if path.is_file() or ("/" in item and path.is_dir()) else None

    items = split_paste(text)
    if items:
        found = [existing(item) for item in items]
        if all(found):
            return list(dict.fromkeys(p for p in found if p))
    whole = text.strip().strip("'\"")
    if whole and "\n" not in whole and (path := existing(whole)):
        return [path]
    return None
