"""The architecture's arrows hold in the imports: `core` imports only itself, `client` reaches the ranks
only over gRPC, the three front ends (`tui`, `headless`, `serve`) import neither each other nor the
CLI, `bench` imports no front end; and no module imports itself through others (no import circles,
counting imports inside functions and under TYPE_CHECKING)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "cpchat"

# package -> the cpchat packages (or modules) it must not import, anywhere inside it
FORBIDDEN = {
    "core": {"client", "rank", "tui", "headless", "serve", "cli", "bench", "checkpoints", "protocol"},
    "client": {"rank", "tui", "headless", "serve", "cli", "bench"},
    "tui": {"rank", "headless", "serve", "cli", "bench"},
    "headless": {"rank", "tui", "serve", "cli", "bench"},
    "serve": {"rank", "tui", "headless", "cli", "bench"},
    "rank": {"client", "tui", "headless", "serve", "cli", "bench"},
    "bench": {"tui", "headless", "serve", "cli"},
}


def cpchat_imports(path: Path) -> set[str]:
    """The first part below `cpchat` of every cpchat module `path` imports."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        modules = [a.name for a in node.names] if isinstance(node, ast.Import) else \
            [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else []
        names |= {m.split(".")[1] for m in modules if m.startswith("cpchat.") and m.count(".") >= 1}
    return names


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_imports_follow_the_arrows(package):
    module = ROOT / f"{package}.py"
    files = [module] if module.exists() else sorted((ROOT / package).rglob("*.py"))
    assert files and "client" in cpchat_imports(ROOT / "tui" / "chat.py"), "the walk finds cpchat imports"
    crossed = {f"{f.relative_to(ROOT)} imports cpchat.{name}" for f in files
               for name in cpchat_imports(f) & FORBIDDEN[package]}
    assert not crossed, sorted(crossed)


def module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(root: Path) -> dict[str, set[str]]:
    """Every module of the package at `root` -> the modules of it that it imports, anywhere in its file
    (`from a import b` counts a.b where b is a module, else a)."""
    files = {module_name(f, root): f for f in root.rglob("*.py")}
    graph = {}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                targets |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*up, *([base] if base else [])])
                targets |= {f"{base}.{a.name}" if f"{base}.{a.name}" in files else base for a in node.names}
        graph[name] = {t for t in targets if t in files and t != name}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_circles(tmp_path):
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "sub" / "__init__.py").write_text("from pkg.sub import b\n")
    (package / "a.py").write_text("def f():\n    from pkg.sub.b import g\n")
    hidden = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .. import a\n"
    (package / "sub" / "b.py").write_text(hidden)
    assert circles(import_graph(package)) == [["pkg.a", "pkg.sub.b"]]  # the finder sees hidden imports
    assert circles(import_graph(ROOT)) == []
