"""Attached folders: pick the files of a directory a user meant, and say briefly what was left out.

Attaching a codebase should bring its sources, not its dependencies, build output, secrets in
dot-files or binaries, so the walk follows .gitignore like git does and prunes the usual suspects
without ever descending into them (a node_modules with 100k files costs one directory entry).
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from pathlib import Path

import pathspec

MAX_FILE_BYTES = 2 << 20  # a single file larger than this is left out ("over 2 MiB")

VCS_DIRS = frozenset({".git", ".hg", ".svn"})
VENDORED_DIRS = frozenset({"node_modules", "vendor", "bower_components", "third_party", "site-packages"})
LOCK_FILES = frozenset({
    "package-lock.json", "yarn.lock", "pnpm-lock.yaml", "Cargo.lock", "poetry.lock", "uv.lock",
    "Pipfile.lock", "Gemfile.lock", "composer.lock", "go.sum", "bun.lockb",
})
MINIFIED_SUFFIXES = (".min.js", ".min.css", ".map")
# Documents the caller converts to text itself: never judged binary, never sniffed.
DOCUMENT_EXTS = frozenset({".pdf", ".epub", ".docx", ".html", ".htm", ".md"})
# Extensions whose content is binary: left out by name, without opening the file.
_BINARY_NAMES = """
    png jpg jpeg gif bmp ico icns webp tif tiff psd heic avif mp3 wav flac ogg oga m4a aac opus
    mp4 m4v mov avi mkv webm wmv flv zip tar gz tgz bz2 xz zst 7z rar lz4 deb rpm dmg iso apk
    msi exe dll so dylib a lib o pyc pyo pyd class jar war whl egg wasm ttf otf woff woff2 eot
    db sqlite sqlite3 bin pkl pickle safetensors gguf npy npz pt pth ckpt onnx h5 hdf5 parquet
    arrow feather tflite pb xlsx xls pptx ppt doc odt
"""
BINARY_EXTS = frozenset("." + ext for ext in _BINARY_NAMES.split())
SNIFF_BYTES = 8192


class ListingCancelled(Exception):
    """The caller set the cancel event while the folder was being walked."""


@dataclass(frozen=True)
class FolderListing:
    root: Path
    files: tuple[Path, ...]  # relative to root, sorted by POSIX path
    left_out: tuple[str, ...]  # one short human line per reason


def _plural(n: int, word: str, words: str | None = None) -> str:
    return f"{n} {word if n == 1 else (words or word + 's')}"


def _named(paths: list[str], limit: int = 3) -> str:
    """A few names are more useful than a count; more than a few are noise."""
    more = f" and {len(paths) - limit} more" if len(paths) > limit else ""
    return ", ".join(paths[:limit]) + more


def _read_spec(path: str) -> pathspec.GitIgnoreSpec | None:
    """Patterns of one ignore file; an unreadable one is treated as absent, as git does."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return pathspec.GitIgnoreSpec.from_lines(f.read().splitlines())
    except OSError:
        return None


def _ignored(specs: list[tuple[str, pathspec.GitIgnoreSpec]], rel: str, is_dir: bool) -> bool:
    """Deepest ignore file with a matching pattern decides, so a subdirectory can re-include."""
    for base, spec in reversed(specs):
        sub = rel[len(base):] + ("/" if is_dir else "")
        result = spec.check_file(sub).include
        if result is not None:
            return result
    return False


def _looks_binary(path: str) -> bool:
    with open(path, "rb") as f:
        return b"\0" in f.read(SNIFF_BYTES)


def list_folder(root: Path, cancel: threading.Event | None = None) -> FolderListing:
    """The files worth reading under root, and why the rest were left out."""
    root = Path(root)
    if not root.is_dir():
        raise NotADirectoryError(f"{root} is not a directory")
    real_root = root.resolve()
    files: list[str] = []
    ignored = [0, 0]  # files, directories
    hidden = locks = minified = binary = 0
    vendored: list[str] = []
    venvs: list[str] = []
    large: list[str] = []
    unreadable: list[str] = []

    root_specs = [("", s) for s in (_read_spec(os.path.join(root, ".git", "info", "exclude")),) if s]
    stack: list[tuple[str, str, list[tuple[str, pathspec.GitIgnoreSpec]]]] = [(str(root), "", root_specs)]
    while stack:
        if cancel is not None and cancel.is_set():
            raise ListingCancelled(str(root))
        path, prefix, specs = stack.pop()
        spec = _read_spec(os.path.join(path, ".gitignore"))
        if spec is not None:
            specs = [*specs, (prefix, spec)]
        try:
            with os.scandir(path) as it:
                entries = sorted(it, key=lambda e: e.name)
        except OSError:
            unreadable.append(prefix or "./")
            continue
        for entry in entries:
            name, rel, is_dir = entry.name, prefix + entry.name, False
            try:
                is_dir = entry.is_dir(follow_symlinks=False)
                if name in VCS_DIRS or name == ".gitignore":
                    continue
                if entry.is_symlink():
                    target = Path(entry.path).resolve()
                    if not target.is_file() or not target.is_relative_to(real_root):
                        continue  # symlinked directories could loop; files outside root are not ours
                elif not (is_dir or entry.is_file(follow_symlinks=False)):
                    continue  # sockets, FIFOs: opening one to sniff it could block
                if _ignored(specs, rel, is_dir):
                    ignored[is_dir] += 1
                elif is_dir and name == "__pycache__":
                    continue
                elif is_dir and name in VENDORED_DIRS:
                    vendored.append(rel + "/")
                elif is_dir and os.path.isfile(os.path.join(entry.path, "pyvenv.cfg")):
                    venvs.append(rel + "/")
                elif name.startswith("."):
                    hidden += 1
                elif is_dir:
                    stack.append((entry.path, rel + "/", specs))
                elif name in LOCK_FILES or name.endswith(".lock"):
                    locks += 1
                elif name.endswith(MINIFIED_SUFFIXES):
                    minified += 1
                else:
                    ext = os.path.splitext(name)[1].lower()
                    if ext in BINARY_EXTS or (ext not in DOCUMENT_EXTS and _looks_binary(entry.path)):
                        binary += 1
                    elif entry.stat().st_size > MAX_FILE_BYTES:
                        large.append(rel)
                    else:
                        files.append(rel)
            except OSError:
                unreadable.append(rel + "/" if is_dir else rel)

    lines: list[str] = []
    if ignored[0] or ignored[1]:
        parts = [_plural(ignored[0], "file")] if ignored[0] else []
        parts += [_plural(ignored[1], "directory", "directories")] if ignored[1] else []
        lines.append(f"{' and '.join(parts)} ignored by .gitignore")
    if vendored:
        lines.append(f"{_named(sorted(vendored))} (vendored)")
    if venvs:
        lines.append(f"{_named(sorted(venvs))} (Python virtual environment)")
    if hidden:
        lines.append(_plural(hidden, "hidden file or directory", "hidden files or directories"))
    if locks:
        lines.append(_plural(locks, "lock file"))
    if minified:
        lines.append(_plural(minified, "minified asset"))
    if binary:
        lines.append(_plural(binary, "binary file"))
    if large:
        cap = f"{MAX_FILE_BYTES >> 20} MiB"
        lines.append(f"{_plural(len(large), 'file')} over {cap}: {_named(sorted(large))}")
    if unreadable:
        lines.append(f"{_plural(len(unreadable), 'unreadable path')}: {_named(sorted(unreadable))}")
    return FolderListing(root, tuple(Path(f) for f in sorted(files)), tuple(lines))
