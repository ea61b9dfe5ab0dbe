"""Documents in the formats people have, written offline with the format libraries themselves."""

from __future__ import annotations

import ctypes
import textwrap
import zipfile
from pathlib import Path

import pypdfium2 as pdfium
import pypdfium2.raw as raw


def write_pdf(path: Path, pages: list[str], image_only: set[int] = frozenset()) -> Path:
    """One page per text, in Helvetica, wrapped at 90 columns; pages in `image_only` get a filled
    rectangle and no text (a scanned page, as far as text extraction can tell)."""
    pdf = pdfium.PdfDocument.new()
    font = raw.FPDFText_LoadStandardFont(pdf, b"Helvetica")
    for number, text in enumerate(pages):
        page = pdf.new_page(612, 792)
        if number in image_only:
            rect = raw.FPDFPageObj_CreateNewRect(50, 50, 500, 700)
            raw.FPDFPageObj_SetFillColor(rect, 90, 90, 90, 255)
            raw.FPDFPath_SetDrawMode(rect, raw.FPDF_FILLMODE_ALTERNATE, 0)
            raw.FPDFPage_InsertObject(page, rect)
        else:
            for i, line in enumerate(textwrap.wrap(text, 90)):
                obj = raw.FPDFPageObj_CreateTextObj(pdf, font, 10.0)
                buffer = ctypes.create_string_buffer((line + "\0").encode("utf-16-le"))
                raw.FPDFText_SetText(obj, ctypes.cast(buffer, ctypes.POINTER(raw.FPDF_WCHAR)))
                raw.FPDFPageObj_Transform(obj, 1, 0, 0, 1, 50, 740 - 14 * i)
                raw.FPDFPage_InsertObject(page, obj)
        raw.FPDFPage_GenerateContent(page)
    pdf.save(str(path))
    pdf.close()
    return path


def encrypt_pdf(source: Path, path: Path, password: str = "secret") -> Path:
    import pypdf

    writer = pypdf.PdfWriter(clone_from=str(source))
    writer.encrypt(password)
    writer.write(str(path))
    return path


def write_docx(path: Path, heading: str, paragraphs: list[str], table: list[list[str]] | None = None) -> Path:
    import docx

    document = docx.Document()
    document.add_heading(heading, level=1)
    for text in paragraphs:
        document.add_paragraph(text)
    if table:
        grid = document.add_table(rows=len(table), cols=len(table[0]))
        for row, cells in zip(grid.rows, table):
            for cell, text in zip(row.cells, cells):
                cell.text = text
    document.save(str(path))
    return path


def write_epub(path: Path, chapters: list[tuple[str, str]], encrypted: bool = False) -> Path:
    """An EPUB 3 as the standard lays it out: mimetype first and stored, container, package, chapters."""
    items = "".join(f'<item id="c{i}" href="text/c{i}.xhtml" media-type="application/xhtml+xml"/>'
                    for i in range(len(chapters)))
    spine = "".join(f'<itemref idref="c{i}"/>' for i in range(len(chapters)))
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(zipfile.ZipInfo("mimetype"), "application/epub+zip")
        z.writestr("META-INF/container.xml", (
            '<?xml version="1.0"?>'
            '<container version="1.0" xmlns="urn:oasis:names:tc:opendocument:xmlns:container">'
            '<rootfiles><rootfile full-path="OEBPS/content.opf" media-type="application/oebps-package+xml"/>'
            "</rootfiles></container>"))
        z.writestr("OEBPS/content.opf", (
            '<?xml version="1.0"?><package xmlns="http://www.idpf.org/2007/opf" version="3.0">'
            f"<metadata/><manifest>{items}</manifest><spine>{spine}</spine></package>"))
        for i, (title, text) in enumerate(chapters):
            body = "".join(f"<p>{p}</p>" for p in text.split("\n\n"))
            z.writestr(f"OEBPS/text/c{i}.xhtml", (
                '<?xml version="1.0" encoding="utf-8"?><html xmlns="http://www.w3.org/1999/xhtml">'
                f"<head><title>{title}</title></head><body><h1>{title}</h1>{body}</body></html>"))
        if encrypted:
            z.writestr("META-INF/encryption.xml", "<encryption/>")
    return path
