"""How attached documents and the user's words become one user message. The demo model is trained on
this format (cpchat.demo.data) and the app sends it (cpchat.client.documents): both use these two
functions, so they cannot drift apart."""

from __future__ import annotations

from collections.abc import Sequence


def render_document(name: str, text: str) -> str:
    """One named text as it appears inside a user message."""
    return f'<document name="{name}">\n{text.strip()}\n</document>'


def user_message(documents: Sequence[tuple[str, str]], text: str) -> str:
    """The (name, text) documents first, then the user's words; the words as they are without one."""
    if not documents:
        return text
    parts = [render_document(name, body) for name, body in documents]
    return "\n\n".join(parts + ([text.strip()] if text.strip() else []))
