"""Which files of an attached folder get read, and what the user is told about the rest."""

from __future__ import annotations

import builtins
import os
import threading
from pathlib import Path

import pytest

from cpchat.client import folders
from cpchat.client.folders import MAX_FILE_BYTES, FolderListing, ListingCancelled, list_folder


def write(root: Path, rel: str, content: str | bytes = "text\n") -> Path:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content)
    return path


@pytest.fixture
def project(tmp_path: Path) -> Path:
    """A codebase with one of everything the listing has to decide about."""
    root = tmp_path / "proj"
    write(root, ".gitignore", "*.log\nbuild/\n!keep.log\n")
    write(root, "keep.log")  # re-included by the negation
    write(root, "debug.log")  # ignored
    write(root, "docs/trace.log")  # ignored at any depth
    write(root, "build/out.txt")  # whole directory pruned...
    write(root, "build/keep.log")  # ...so the negation cannot bring this back, as in git
    write(root, "src/.gitignore", "generated.py\n!important.log\n")
    write(root, "src/generated.py")  # ignored by the nested file
    write(root, "src/sub/generated.py")  # and below it
    write(root, "src/important.log")  # nested negation beats the root's *.log
    write(root, "generated.py")  # the nested pattern does not reach outside src/
    write(root, ".git/HEAD", "ref: refs/heads/main\n")
    write(root, ".git/config")
    write(root, ".git/info/exclude", "excluded.txt\n")
    write(root, "excluded.txt")  # ignored through .git/info/exclude
    write(root, "README.md", "# proj\n")
    write(root, "src/main.py", "print('hi')\n")
    write(root, "src/util.py")
    write(root, "src/sub/helper.py")
    write(root, "docs/notes.md")
    write(root, "docs/page.html", "<p>hi</p>\n")
    write(root, "docs/guide.pdf", b"%PDF-1.7\n\0\0\x01stream")  # the caller converts it: never sniffed
    for i in range(5):
        write(root, f"node_modules/pkg{i}/index.js")
    write(root, "vendor/lib.go")
    write(root, "src/third_party/dep.c")
    write(root, "src/__pycache__/main.cpython-311.pyc", b"\0\0")  # silent
    write(root, "myenv/pyvenv.cfg", "home = /usr/bin\n")
    write(root, "myenv/lib/python3.11/site-packages/mod.py")
    write(root, ".venv/pyvenv.cfg", "home = /usr/bin\n")  # a venv first, hidden second
    write(root, ".env", "SECRET=1\n")
    write(root, ".config/settings.toml")
    write(root, "src/.hidden.py")
    write(root, "package-lock.json", "{}")
    write(root, "Cargo.lock")
    write(root, "go.sum")
    write(root, "src/custom.lock")
    write(root, "static/app.js")
    write(root, "static/app.min.js")
    write(root, "static/app.min.css")
    write(root, "static/app.js.map")
    write(root, "logo.png", "not really a png\n")  # judged by extension alone
    write(root, "data/blob", b"ELF\0\x01\x02 rest")  # judged by its NUL byte
    write(root, "data/exact.csv", b"x" * MAX_FILE_BYTES)  # at the cap: kept
    write(root, "data/big.csv", b"x" * (MAX_FILE_BYTES + 1))
    write(tmp_path, "outside.txt")
    (root / "loop").symlink_to(root, target_is_directory=True)
    (root / "link_to_main.py").symlink_to(root / "src" / "main.py")
    (root / "escape.txt").symlink_to(tmp_path / "outside.txt")
    (root / "dangling.txt").symlink_to(root / "missing.txt")
    return root


EXPECTED_FILES = [
    "README.md",
    "data/exact.csv",
    "docs/guide.pdf",
    "docs/notes.md",
    "docs/page.html",
    "generated.py",
    "keep.log",
    "link_to_main.py",
    "src/important.log",
    "src/main.py",
    "src/sub/helper.py",
    "src/util.py",
    "static/app.js",
]

EXPECTED_LEFT_OUT = (
    "5 files and 1 directory ignored by .gitignore",
    "node_modules/, src/third_party/, vendor/ (vendored)",
    ".venv/, myenv/ (Python virtual environment)",
    "3 hidden files or directories",
    "4 lock files",
    "3 minified assets",
    "2 binary files",
    "1 file over 2 MiB: data/big.csv",
)


def test_lists_exactly_the_files_meant(project: Path) -> None:
    listing = list_folder(project)
    assert isinstance(listing, FolderListing)
    assert listing.root == project
    assert all(isinstance(p, Path) and not p.is_absolute() for p in listing.files)
    assert [p.as_posix() for p in listing.files] == EXPECTED_FILES


def test_says_what_was_left_out_and_why(project: Path) -> None:
    assert list_folder(project).left_out == EXPECTED_LEFT_OUT


def test_listing_is_stable(project: Path) -> None:
    assert list_folder(project) == list_folder(project)


def test_pruned_directories_are_never_walked(project: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    scanned: list[str] = []
    real_scandir = os.scandir

    def recording_scandir(path):
        scanned.append(Path(path).relative_to(project).as_posix())
        return real_scandir(path)

    monkeypatch.setattr(folders.os, "scandir", recording_scandir)
    list_folder(project)
    assert sorted(scanned) == [".", "data", "docs", "src", "src/sub", "static"]


def test_small_folder_has_nothing_to_report(tmp_path: Path) -> None:
    write(tmp_path, "b.txt")
    write(tmp_path, "a/z.py")
    write(tmp_path, "B.md")
    listing = list_folder(tmp_path)
    assert [p.as_posix() for p in listing.files] == ["B.md", "a/z.py", "b.txt"]
    assert listing.left_out == ()


def test_names_at_most_three_large_files(tmp_path: Path) -> None:
    for name in "edcba":
        write(tmp_path, f"{name}.txt", b"y" * (MAX_FILE_BYTES + 1))
    write(tmp_path, "small.txt")
    listing = list_folder(tmp_path)
    assert [p.as_posix() for p in listing.files] == ["small.txt"]
    assert listing.left_out == ("5 files over 2 MiB: a.txt, b.txt, c.txt and 2 more",)


def test_singular_and_directory_only_wording(tmp_path: Path) -> None:
    write(tmp_path, ".gitignore", "out/\n")
    write(tmp_path, "out/a.txt")
    write(tmp_path, ".hidden")
    write(tmp_path, "yarn.lock")
    write(tmp_path, "x.min.js")
    write(tmp_path, "song.mp3")
    assert list_folder(tmp_path).left_out == (
        "1 directory ignored by .gitignore",
        "1 hidden file or directory",
        "1 lock file",
        "1 minified asset",
        "1 binary file",
    )


def test_unreadable_paths_are_reported_not_raised(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write(tmp_path, "ok.txt")
    write(tmp_path, "locked/inside.txt")
    write(tmp_path, "secret.dat")
    real_scandir, real_open = os.scandir, builtins.open

    def scandir(path):
        if Path(path).name == "locked":
            raise PermissionError(13, "Permission denied", str(path))
        return real_scandir(path)

    def open_(path, *args, **kwargs):
        if Path(path).name == "secret.dat":
            raise PermissionError(13, "Permission denied", str(path))
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(folders.os, "scandir", scandir)
    monkeypatch.setattr(folders, "open", open_, raising=False)
    listing = list_folder(tmp_path)
    assert [p.as_posix() for p in listing.files] == ["ok.txt"]
    assert listing.left_out == ("2 unreadable paths: locked/, secret.dat",)


def test_cancel_before_the_call_raises(project: Path) -> None:
    cancel = threading.Event()
    cancel.set()
    with pytest.raises(ListingCancelled):
        list_folder(project, cancel)


def test_cancel_during_the_walk_stops_promptly(project: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cancel = threading.Event()
    calls: list[str] = []
    real_scandir = os.scandir

    def scandir(path):
        calls.append(str(path))
        cancel.set()  # the user presses Escape while the first directory is being read
        return real_scandir(path)

    monkeypatch.setattr(folders.os, "scandir", scandir)
    with pytest.raises(ListingCancelled):
        list_folder(project, cancel)
    assert len(calls) == 1


def test_root_must_be_a_directory(tmp_path: Path) -> None:
    file = write(tmp_path, "file.txt")
    with pytest.raises(NotADirectoryError):
        list_folder(file)
    with pytest.raises(NotADirectoryError):
        list_folder(tmp_path / "missing")
