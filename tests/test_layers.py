"""The architecture's arrows hold in the imports: `core` imports only itself, `client` reaches the ranks
only over gRPC, and the three front ends (`tui`, `headless`, `serve`) import neither each other nor
the CLI."""

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
