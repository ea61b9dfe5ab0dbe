"""Document formats to text: PDF, EPUB, HTML, DOCX and plain text or code.

Chosen for what they cost a user's install and what they keep (measured in the #20 note):
pypdfium2 reads PDFs page by page (PDFium: 10x faster than pypdf or pdfminer here, same
text), EPUB is a zip of XHTML chapters read with the standard library, HTML and DOCX
(through mammoth) become Markdown with markdownify, so headings, lists and tables survive.
PDF pages and EPUB chapters keep a marker line (`[page 12]`), so an answer can point to them.
"""

from __future__ import annotations

import io
import threading
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import PurePosixPath
from xml.etree import ElementTree

Progress = Callable[[int, int], None]

CODE = {
    ".py": "Python", ".rs": "Rust", ".go": "Go", ".c": "C", ".h": "C", ".cc": "C++", ".cpp": "C++",
    ".hpp": "C++", ".java": "Java", ".kt": "Kotlin", ".swift": "Swift", ".js": "JavaScript",
    ".ts": "TypeScript", ".tsx": "TypeScript", ".jsx": "JavaScript", ".rb": "Ruby", ".php": "PHP",
    ".cs": "C#", ".scala": "Scala", ".sh": "shell", ".sql": "SQL", ".proto": "protobuf", ".lua": "Lua",
    ".toml": "TOML", ".yaml": "YAML", ".yml": "YAML", ".json": "JSON", ".css": "CSS", ".tcss": "CSS",
}
MARKDOWN = {".md", ".markdown", ".mdx", ".rst"}
HTML = {".html", ".htm", ".xhtml"}
UNSUPPORTED = {  # recognised, but not read: say so by name, with the way out
    ".pptx": "PPTX", ".xlsx": "XLSX", ".odt": "ODT", ".ods": "ODS", ".odp": "ODP", ".rtf": "RTF",
    ".doc": "DOC", ".xls": "XLS", ".ppt": "PPT",
}


UTF16_BOMS = (b"\xff\xfe", b"\xfe\xff")


class Unreadable(Exception):
    """Why a file cannot be read as a document (the caller adds the file's name)."""


class ReadCancelled(Exception):
    pass


@dataclass(frozen=True)
class Extracted:
    kind: str  # "PDF", "EPUB", "HTML", "DOCX", "Markdown", "text" or a language name
    text: str
    pages: int = 0  # pages (PDF) or chapters (EPUB); 0 where the format has neither
    unit: str = ""


def extract(name: str, data: bytes, progress: Progress | None = None,
            cancel: threading.Event | None = None) -> Extracted:
    """The text of one file, by what its bytes are (the extension only breaks ties)."""
    suffix = PurePosixPath(name).suffix.lower()
    step = Steps(progress, cancel)
    if data.startswith(b"%PDF-") or suffix == ".pdf":
        return pdf_text(data, step)
    if data.startswith(b"PK\x03\x04"):
        return _zipped(data, suffix, step)
    if data.startswith(b"\xd0\xcf\x11\xe0"):
        raise Unreadable("is an old binary Office file or a password-protected one: save it as PDF or DOCX")
    if suffix in UNSUPPORTED:
        raise Unreadable(f"{UNSUPPORTED[suffix]} is not a format cpchat reads: save it as PDF")
    if b"\0" in data[:8192] and not data.startswith(UTF16_BOMS):
        raise Unreadable("looks binary, not a document (cpchat reads PDF, EPUB, HTML, DOCX and text)")
    text = decode_text(data)
    if suffix in HTML or text.lstrip()[:15].lower().startswith(("<!doctype html", "<html")):
        return Extracted("HTML", html_to_markdown(text))
    kind = "Markdown" if suffix in MARKDOWN else CODE.get(suffix, "text")
    return Extracted(kind, text)


def decode_text(data: bytes) -> str:
    if data.startswith(UTF16_BOMS):
        return data.decode("utf-16")
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError:
        raise Unreadable("is not UTF-8 text") from None


class Steps:
    """Progress reports and the cancel check, between pages, chapters or a folder's files."""

    def __init__(self, progress: Progress | None, cancel: threading.Event | None) -> None:
        self.progress, self.cancel = progress, cancel

    def __call__(self, done: int, total: int) -> None:
        if self.cancel is not None and self.cancel.is_set():
            raise ReadCancelled
        if self.progress is not None:
            self.progress(done, total)


# ---- PDF


def pdf_text(data: bytes, step: Steps) -> Extracted:
    import pypdfium2 as pdfium

    try:
        pdf = pdfium.PdfDocument(data)
    except pdfium.PdfiumError as e:
        if "password" in str(e).lower():
            raise Unreadable("is a password-protected PDF") from None
        raise Unreadable("is not a readable PDF (a damaged or truncated file)") from None
    count, pages, with_text = len(pdf), [], 0
    try:
        for i in range(count):
            step(i, count)
            text = pdf[i].get_textpage().get_text_range().replace("\r\n", "\n").strip()
            with_text += bool(text)
            pages.append(f"[page {i + 1}]\n{text}" if text else f"[page {i + 1}]")
        step(count, count)
    finally:
        pdf.close()
    if count and not with_text:
        raise Unreadable("has no text layer (scanned pages?): run OCR first, e.g. `ocrmypdf in.pdf out.pdf`")
    return Extracted("PDF", "\n\n".join(pages), count, "pages")


# ---- zipped formats: EPUB, DOCX


def _zipped(data: bytes, suffix: str, step: Steps) -> Extracted:
    try:
        archive = zipfile.ZipFile(io.BytesIO(data))
        names = set(archive.namelist())
    except (zipfile.BadZipFile, ValueError):
        raise Unreadable("is a damaged zip archive") from None
    try:
        if "META-INF/container.xml" in names or suffix == ".epub":
            return epub_text(archive, names, step)
        if "word/document.xml" in names:
            return docx_text(data)
    except (zipfile.BadZipFile, KeyError, ElementTree.ParseError, EOFError, ValueError) as e:
        raise Unreadable(f"is a damaged archive ({e})") from None
    for prefix, kind in (("ppt/", "PPTX"), ("xl/", "XLSX")):
        if any(n.startswith(prefix) for n in names):
            raise Unreadable(f"{kind} is not a format cpchat reads: save it as PDF")
    raise Unreadable("is a zip archive, not a document")


_OPF = "{http://www.idpf.org/2007/opf}"
_CONTAINER = "{urn:oasis:names:tc:opendocument:xmlns:container}"


def epub_text(archive: zipfile.ZipFile, names: set[str], step: Steps) -> Extracted:
    """The spine's chapters in reading order, each as Markdown after a `[chapter N]` line."""
    if "META-INF/encryption.xml" in names:
        raise Unreadable("is a DRM-protected EPUB (its chapters are encrypted)")
    container = ElementTree.fromstring(archive.read("META-INF/container.xml"))
    rootfile = container.find(f".//{_CONTAINER}rootfile")
    if rootfile is None:
        raise Unreadable("is an EPUB without a package document")
    opf_path = PurePosixPath(rootfile.attrib["full-path"])
    opf = ElementTree.fromstring(archive.read(str(opf_path)))
    hrefs = {item.attrib["id"]: item.attrib["href"] for item in opf.iter(f"{_OPF}item")}
    spine = [hrefs[ref.attrib["idref"]] for ref in opf.iter(f"{_OPF}itemref") if ref.attrib["idref"] in hrefs]
    chapters = []
    for i, href in enumerate(spine):
        step(i, len(spine))
        text = html_to_markdown(decode_text(archive.read(str(opf_path.parent / href)))).strip()
        if text:
            chapters.append(f"[chapter {len(chapters) + 1}]\n{text}")
    step(len(spine), len(spine))
    if not chapters:
        raise Unreadable("is an EPUB with no text in its chapters")
    return Extracted("EPUB", "\n\n".join(chapters), len(chapters), "chapters")


def docx_text(data: bytes) -> Extracted:
    import mammoth

    html = mammoth.convert_to_html(io.BytesIO(data)).value
    return Extracted("DOCX", html_to_markdown(html))


# ---- HTML


def html_to_markdown(html: str) -> str:
    """Markdown of the page's content: scripts, styles and navigation go, headings and tables stay."""
    from bs4 import BeautifulSoup
    from markdownify import MarkdownConverter

    soup = BeautifulSoup(html, "html.parser")
    for tag in soup(["script", "style", "noscript", "template", "nav", "svg"]):
        tag.decompose()
    title = soup.title.get_text(strip=True) if soup.title else ""
    if soup.head:
        soup.head.decompose()
    body = MarkdownConverter(heading_style="ATX", strip=["img"]).convert_soup(soup)
    body = "\n".join(line.rstrip() for line in body.splitlines())
    while "\n\n\n" in body:
        body = body.replace("\n\n\n", "\n\n")
    return f"# {title}\n\n{body.strip()}" if title and title not in body[:200] else body.strip()
