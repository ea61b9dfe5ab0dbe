"""Documents as people have them: formats to text with their page and chapter markers, folders as
one set, and a one-line reason for every file that cannot be read."""

from __future__ import annotations

import threading
import zipfile
from pathlib import Path

import pytest
from makedocs import encrypt_pdf, write_docx, write_epub, write_pdf

from cpchat.client import documents
from cpchat.client.documents import DocumentCancelled, read_document, render_user_turn
from cpchat.errors import BadInput

FACT = "The access code for the Cedar mill is 7712-MR."


def refused(path: Path, words: str) -> str:
    with pytest.raises(BadInput) as e:
        read_document(path)
    message = str(e.value)
    assert str(path) in message and words in message and "\n" not in message, message
    return message


def test_pdf_pages_keep_their_markers(tmp_path):
    pdf = write_pdf(tmp_path / "report.pdf", ["Opening words.", f"Some filler. {FACT}", "Closing words."])
    d = read_document(pdf)
    assert (d.kind, d.pages, d.unit, d.files) == ("PDF", 3, "pages", 1)
    text = d.sections[0].text
    assert text.index("[page 1]") < text.index("Opening") < text.index("[page 2]") < text.index(FACT)
    assert text.index(FACT) < text.index("[page 3]") < text.index("Closing")
    assert d.size == pdf.stat().st_size


def test_pdf_refusals_name_the_file_and_the_reason(tmp_path):
    pdf = write_pdf(tmp_path / "plain.pdf", [FACT])
    refused(encrypt_pdf(pdf, tmp_path / "locked.pdf"), "password-protected")
    (tmp_path / "cut.pdf").write_bytes(pdf.read_bytes()[:200])
    refused(tmp_path / "cut.pdf", "damaged or truncated")
    refused(write_pdf(tmp_path / "scan.pdf", ["", ""], image_only={0, 1}), "no text layer")


def test_a_scanned_page_among_text_pages_keeps_its_marker(tmp_path):
    d = read_document(write_pdf(tmp_path / "mixed.pdf", ["One.", "", "Three."], image_only={1}))
    assert "[page 2]\n\n[page 3]\nThree." in d.sections[0].text


def test_reading_reports_progress_and_stops_on_cancel(tmp_path):
    pdf = write_pdf(tmp_path / "long.pdf", [f"Page {i} text." for i in range(6)])
    seen: list[tuple[int, int]] = []
    read_document(pdf, progress=lambda done, total: seen.append((done, total)))
    assert seen == [(i, 6) for i in range(7)]
    cancel = threading.Event()

    def stop_after_two(done: int, total: int) -> None:
        if done == 2:
            cancel.set()

    with pytest.raises(DocumentCancelled):
        read_document(pdf, progress=stop_after_two, cancel=cancel)


def test_epub_chapters_in_spine_order(tmp_path):
    book = write_epub(tmp_path / "book.epub", [("Arrival", "It rained.\n\nThen it stopped."),
                                               ("The Mill", f"Quiet days. {FACT}")])
    d = read_document(book)
    assert (d.kind, d.pages, d.unit) == ("EPUB", 2, "chapters")
    text = d.sections[0].text
    assert text.index("[chapter 1]") < text.index("# Arrival") < text.index("Then it stopped.")
    assert text.index("[chapter 2]") < text.index("# The Mill") < text.index(FACT)
    refused(write_epub(tmp_path / "drm.epub", [("A", "b")], encrypted=True), "DRM")
    (tmp_path / "cut.epub").write_bytes(book.read_bytes()[:300])
    refused(tmp_path / "cut.epub", "damaged")


def test_docx_keeps_headings_paragraphs_and_tables(tmp_path):
    docx = write_docx(tmp_path / "memo.docx", "Site notes", ["First paragraph.", FACT],
                      table=[["Site", "Code"], ["Cedar mill", "7712-MR"]])
    d = read_document(docx)
    assert d.kind == "DOCX" and d.pages == 0
    text = d.sections[0].text
    assert "# Site notes" in text and "First paragraph." in text and FACT in text
    assert "| Cedar mill | 7712-MR |" in text
    (tmp_path / "cut.docx").write_bytes(docx.read_bytes()[:400])
    refused(tmp_path / "cut.docx", "damaged")


def test_html_becomes_markdown_without_scripts(tmp_path):
    page = tmp_path / "saved"  # no extension: recognised by its content
    page.write_text("<!DOCTYPE html><html><head><title>Mill records</title><style>p{}</style></head><body>"
                    "<nav><a href='/'>Home</a></nav><script>var secret = 1;</script>"
                    f"<h2>Codes</h2><ul><li>{FACT}</li></ul></body></html>")
    d = read_document(page)
    assert d.kind == "HTML"
    text = d.sections[0].text
    assert text.startswith("# Mill records") and "## Codes" in text and f"* {FACT}" in text
    assert "secret" not in text and "Home" not in text and "p{}" not in text


def test_text_markdown_and_code_are_read_as_they_are(tmp_path):
    cases = {"notes.md": ("# Notes\n", "Markdown"), "main.py": ("print(1)\n", "Python"),
             "log.txt": ("a line\n", "text"), "Makefile": ("all:\n", "text")}
    for name, (content, kind) in cases.items():
        (tmp_path / name).write_text(content)
        d = read_document(tmp_path / name)
        assert (d.kind, d.sections[0].text) == (kind, content), name
    (tmp_path / "wide.txt").write_bytes("café".encode("utf-16"))
    assert read_document(tmp_path / "wide.txt").sections[0].text == "café"


def test_what_cannot_be_read_is_named(tmp_path):
    (tmp_path / "latin.txt").write_bytes("caf\xe9".encode("latin-1"))
    refused(tmp_path / "latin.txt", "not UTF-8")
    (tmp_path / "image.png").write_bytes(b"\x89PNG\r\n\x1a\n\0\0\0")
    refused(tmp_path / "image.png", "looks binary")
    with zipfile.ZipFile(tmp_path / "slides.pptx", "w") as z:
        z.writestr("ppt/presentation.xml", "<p/>")
    refused(tmp_path / "slides.pptx", "PPTX is not a format cpchat reads")
    (tmp_path / "old.doc").write_bytes(b"\xd0\xcf\x11\xe0" + b"\0" * 100)
    refused(tmp_path / "old.doc", "old binary Office file")
    refused(tmp_path / "missing.pdf", "no such file or folder")


def test_a_folder_is_one_document_set(tmp_path):
    root = tmp_path / "project"
    (root / "docs").mkdir(parents=True)
    (root / "src").mkdir()
    (root / ".gitignore").write_text("*.log\n")
    (root / "README.md").write_text("# Project\n")
    (root / "src" / "mill.py").write_text(f"# {FACT}\n")
    (root / "debug.log").write_text("noise\n")
    write_pdf(root / "docs" / "manual.pdf", ["Intro.", "Details."])
    (root / "docs" / "broken.pdf").write_bytes(b"%PDF-1.7 nothing more")
    d = read_document(root)
    assert (d.kind, d.name, d.files) == ("folder", "project", 3)
    names = ["project/README.md", "project/docs/manual.pdf", "project/src/mill.py"]
    assert [s.name for s in d.sections] == names
    assert "[page 2]\nDetails." in d.sections[1].text
    assert any("ignored by .gitignore" in line for line in d.left_out)
    assert any(line.startswith("1 unreadable: docs/broken.pdf") for line in d.left_out), d.left_out
    turn = render_user_turn([d], "What is the access code for the Cedar mill?")
    assert turn.count("<document name=") == 3
    assert f'<document name="project/src/mill.py">\n# {FACT}\n</document>' in turn


def test_a_folder_past_the_text_cap_says_what_it_left_out(tmp_path, monkeypatch):
    for i in range(5):
        (tmp_path / f"part{i}.txt").write_text("x" * 100)
    monkeypatch.setattr(documents, "MAX_FOLDER_TEXT", 150)
    d = read_document(tmp_path)
    assert d.files == 2
    assert "3 files past the cap of 150 characters, from part2.txt on" in d.left_out


def test_an_empty_folder_is_refused(tmp_path):
    (tmp_path / "node_modules").mkdir()
    (tmp_path / "node_modules" / "x.js").write_text("x")
    refused(tmp_path, "has no text files to attach")
