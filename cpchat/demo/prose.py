"""Real English prose for the demo model's documents, from texts that install with Debian and Python.

Four styles: licences (/usr/share/common-licenses), reference documentation
(docstrings of Python's standard library), manuals (the DESCRIPTION of Perl's
core modules) and READMEs (/usr/share/doc). All of them may be copied, and
they are only read at training time, never shipped. Each source goes whole to
one pool: "train", or "heldout" (about a fifth of them, and the Apache-2.0 and
MPL licences), which training never reads.
"""

from __future__ import annotations

import ast
import gzip
import inspect
import re
import zlib
from dataclasses import dataclass
from functools import cache
from pathlib import Path

LICENCES = Path("/usr/share/common-licenses")
PERL = Path("/usr/share/perl")
DEBIAN_DOCS = Path("/usr/share/doc")
HELD_OUT_LICENCES = ("Apache-2.0", "MPL-1.1", "MPL-2.0")
SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z(\"'])")
POD_CODE = re.compile(r"[A-Z]<+\s*([^<>]*?)\s*>+")


@dataclass(frozen=True)
class Source:
    """One text: its name (style/file) and its paragraphs, each a list of sentences."""

    name: str
    paragraphs: tuple[tuple[str, ...], ...]

    @property
    def chars(self) -> int:
        return sum(len(s) + 1 for p in self.paragraphs for s in p)


def pool_of(name: str) -> str:
    """Which pool a source belongs to: fixed by its name, so every machine splits alike."""
    if name.startswith("licence/"):
        return "heldout" if name.split("/", 1)[1] in HELD_OUT_LICENCES else "train"
    return "heldout" if zlib.crc32(name.encode()) % 5 == 0 else "train"


def prose_paragraphs(text: str) -> tuple[tuple[str, ...], ...]:
    """Paragraphs of running prose: blank-line separated, code, tables and headings left out."""
    out = []
    for block in re.split(r"\n\s*\n", text):
        lines = [line.strip() for line in block.strip().splitlines()]
        if not lines or any(line.startswith((">>>", "...", "$ ", "#", "|", "=", "-" * 3)) for line in lines):
            continue
        para = " ".join(lines)
        words = para.split()
        if len(words) < 8 or sum(c.isalpha() or c in " ,.;:'()-\"" for c in para) < 0.93 * len(para):
            continue
        sentences = tuple(s for s in SENTENCE_END.split(para) if 3 <= len(s.split()) <= 80)
        if sentences:
            out.append(sentences)
    return tuple(out)


def _licences() -> list[Source]:
    return [Source(f"licence/{p.name}", prose_paragraphs(p.read_text(errors="replace")))
            for p in sorted(LICENCES.glob("*")) if p.is_file() and not p.is_symlink()]


def _docstrings() -> list[Source]:
    stdlib = Path(inspect.getfile(ast)).parent
    out = []
    for path in sorted(stdlib.glob("*.py")):
        try:
            tree = ast.parse(path.read_text(errors="replace"))
        except (SyntaxError, ValueError):
            continue
        docs = [ast.get_docstring(node) for node in ast.walk(tree)
                if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)]
        text = "\n\n".join(d for d in docs if d)
        out.append(Source(f"python/{path.stem}", prose_paragraphs(text)))
    return out


def _perl_manuals() -> list[Source]:
    out = []
    for path in sorted({p.resolve() for p in PERL.glob("*/**/*.pm")}):
        text = path.read_text(errors="replace")
        found = re.search(r"^=head1 DESCRIPTION\s*\n(.*?)(?=^=head1|^=cut|\Z)", text, re.M | re.S)
        if found:
            body = "\n\n".join(b for b in re.split(r"\n\s*\n", found.group(1))
                               if b.strip() and not b.startswith((" ", "\t", "=")))
            out.append(Source(f"perl/{path.relative_to(PERL.resolve())}", prose_paragraphs(
                POD_CODE.sub(r"\1", body))))
    return out


def _readmes() -> list[Source]:
    out = []
    for path in sorted(DEBIAN_DOCS.glob("*/README*")):
        raw = path.read_bytes()
        text = (gzip.decompress(raw) if path.suffix == ".gz" else raw).decode(errors="replace")
        out.append(Source(f"readme/{path.parent.name}/{path.name}", prose_paragraphs(text)))
    return out


@cache
def load_pool(pool: str) -> tuple[Source, ...]:
    """Every source of `pool` ("train" or "heldout") that has prose on this machine."""
    sources = _licences() + _docstrings() + _perl_manuals() + _readmes()
    return tuple(s for s in sources if s.paragraphs and pool_of(s.name) == pool)


if __name__ == "__main__":  # the pools' sizes by style: python -m cpchat.demo.prose
    for pool in ("train", "heldout"):
        sources = load_pool(pool)
        styles: dict[str, list[int]] = {}
        for s in sources:
            styles.setdefault(s.name.split("/")[0], []).append(s.chars)
        print(pool, {k: (len(v), sum(v)) for k, v in styles.items()})
