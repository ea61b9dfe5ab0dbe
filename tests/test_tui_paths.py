"""Pure parts of the TUI: the drop-paste parser, the transcript store, formatting."""

from __future__ import annotations

import json
from pathlib import Path
from urllib.parse import quote

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cpchat.client.transcripts import Entry, TranscriptStore
from cpchat.format import human_bytes
from cpchat.tui.format import bar
from cpchat.tui.paths import leading_paths, parse_dropped_paths, split_paste


@pytest.fixture
def files(tmp_path: Path) -> tuple[Path, Path]:
    a = tmp_path / "my notes (v2).txt"
    b = tmp_path / "été 100%.md"
    a.write_text("a")
    b.write_text("b")
    return a, b


@pytest.mark.parametrize(
    "text, expected",
    [
        ("/x/plain.txt", ["/x/plain.txt"]),
        ("'/x/a b.txt'", ["/x/a b.txt"]),
        ('"/x/a b.txt"', ["/x/a b.txt"]),
        ("/x/a\\ b.txt", ["/x/a b.txt"]),
        ("file:///x/a%20b.txt", ["/x/a b.txt"]),
        ("file://localhost/x/%C3%A9t%C3%A9.md", ["/x/été.md"]),
        ("/x/a.txt /x/b.txt", ["/x/a.txt", "/x/b.txt"]),
        ("'/x/a b.txt'\n/x/c.txt\n", ["/x/a b.txt", "/x/c.txt"]),
        ("it's a trap", None),
        ("", None),
        ("file://otherhost/x.txt", None),
    ],
)
def test_split_paste(text, expected):
    assert split_paste(text) == expected


def test_every_drop_form_names_existing_files(files):
    a, b = files
    escaped = str(a).replace(" ", "\\ ").replace("(", "\\(").replace(")", "\\)")
    forms = [
        (f"'{a}'", [a]),
        (f'"{b}"', [b]),
        (escaped, [a]),
        ("file://" + quote(str(b)), [b]),
        (f"{escaped} '{b}'", [a, b]),
        (f"file://{quote(str(a))}\nfile://{quote(str(b))}", [a, b]),
        (str(a), [a]),  # unquoted with spaces: some terminals paste it so
    ]
    for text, expected in forms:
        assert parse_dropped_paths(text) == expected, text


def test_text_and_missing_files_stay_text(files, tmp_path):
    a, _ = files
    assert parse_dropped_paths("hello world") is None
    assert parse_dropped_paths(f"'{a}' {tmp_path / 'missing.txt'}") is None, "all or nothing"
    assert parse_dropped_paths(f"see '{a}'") is None


def test_a_dropped_folder_is_attached_but_a_bare_word_is_text(tmp_path):
    (tmp_path / "notes").mkdir()
    assert parse_dropped_paths(str(tmp_path / "notes")) == [tmp_path / "notes"]
    assert parse_dropped_paths(f"file://{quote(str(tmp_path))}/notes/") == [tmp_path / "notes"]
    assert parse_dropped_paths("notes", cwd=tmp_path) is None, "a word that names a folder is text"
    assert parse_dropped_paths("./notes", cwd=tmp_path) == [tmp_path / "notes"]


@given(st.text(max_size=80))
def test_parser_never_raises(text):
    result = parse_dropped_paths(text, cwd=Path("/nonexistent-cpchat"))
    assert result is None or all(p.exists() for p in result)
    typed = leading_paths(text, cwd=Path("/nonexistent-cpchat"))
    assert typed is None or all(p.exists() for p in typed[0])


def test_a_typed_message_that_starts_with_paths(files, tmp_path, monkeypatch):
    """Paths written as paths (absolute, ~/, ./, quoted, escaped) before the question are offered for
    attaching; a bare file name, a missing path or a path later in the message stay text."""
    a, b = files
    (tmp_path / "notes").mkdir()
    monkeypatch.setenv("HOME", str(tmp_path))
    question = "What is in it?"
    assert leading_paths(f"'{a}' {question}") == ([a], question)
    assert leading_paths(f'"{a}"   {question}  ') == ([a], question + "  ")
    assert leading_paths(str(a).replace(" ", "\\ ") + f" {question}") == ([a], question)
    assert leading_paths(f"~/'{a.name}' {question}") == ([a], question)
    assert leading_paths(f"./notes {question}", cwd=tmp_path) == ([tmp_path / "notes"], question)
    assert leading_paths(f"'{a}' ~/'{b.name}'") == ([a, b], ""), "only paths: no question"
    assert leading_paths(f"'{a}' '{a}' {question}") == ([a], question), "named twice, attached once"
    assert leading_paths(f"{tmp_path}/missing.txt {question}") is None
    assert leading_paths(f"'{a.name}' {question}", cwd=tmp_path) is None, "a bare file name is text"
    assert leading_paths(f"notes {question}", cwd=tmp_path) is None
    assert leading_paths(f"{question} '{a}'") is None, "only where the message starts"
    assert leading_paths(f"'{a} {question}") is None, "an unmatched quote"
    assert leading_paths("https://example.com/a.txt what is it") is None


def test_store_round_trip_and_torn_line(tmp_path):
    store = TranscriptStore(tmp_path)
    store.add(Entry("user", "hi", "<document …>\n\nhi", ["a.txt"]))
    for piece in ("Hel", "lo", "!"):
        store.delta(piece)
    store.end()
    store.delta("partial")  # a crash mid-answer
    store.flush()
    with open(store.path, "a") as f:
        f.write('{"role": "assistant", "del')  # torn by the crash
    entries = TranscriptStore.load(store.path)
    shown = [(e.role, e.text) for e in entries]
    assert shown == [("user", "hi"), ("assistant", "Hello!"), ("assistant", "partial")]
    assert entries[0].docs == ["a.txt"] and entries[0].content.startswith("<document")
    assert TranscriptStore.last(tmp_path) == store.path
    assert all(json.loads(line) for line in store.path.read_text().splitlines()[:-1])


def test_format_helpers():
    assert human_bytes(512) == "512 B" and human_bytes(1536) == "1.5 KiB"
    assert human_bytes(3 << 30) == "3.0 GiB"
    assert bar(0, 4) == "    " and bar(1, 4) == "████" and len(bar(0.3, 10)) == 10
