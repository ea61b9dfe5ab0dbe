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


def leading_paths(text: str, cwd: Path | None = None) -> tuple[list[Path], str] | None:
    """The existing files and folders a typed message starts with, and the rest of it; None when it
    does not start with one. A path is written as a path (absolute, `~/…` or with a `/`), plain,
    quoted or with escaped spaces: a bare word that happens to name a file here stays text."""
    base = cwd or Path.cwd()
    paths: list[Path] = []
    rest = text.lstrip()
    while rest:
        word, after = _shell_word(rest)
        if word is None or "/" not in word:
            break
        path = Path(os.path.expanduser(word))
        path = path if path.is_absolute() else base / path
        if not path.exists():
            break
        paths.append(path)
        rest = after.lstrip()
    return (list(dict.fromkeys(paths)), rest) if paths else None


def _shell_word(text: str) -> tuple[str | None, str]:
    """The first word of `text` as a shell reads it (quotes and backslash escapes), and what follows
    it; None for an unmatched quote."""
    word, i, quote = [], 0, ""
    while i < len(text):
        c = text[i]
        if quote:
            if c == quote:
                quote = ""
            elif c == "\\" and quote == '"' and i + 1 < len(text) and text[i + 1] in '"\\':
                i += 1
                word.append(text[i])
            else:
                word.append(c)
        elif c in "'\"":
            quote = c
        elif c == "\\" and i + 1 < len(text):
            i += 1
            word.append(text[i])
        elif c.isspace():
            break
        else:
            word.append(c)
        i += 1
    return (None, text) if quote else ("".join(word), text[i:])
