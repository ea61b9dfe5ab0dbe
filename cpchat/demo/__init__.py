"""The built-in demo model: a small llama trained to answer questions about an attached document."""

from cpchat.demo.data import NOT_FOUND, render_document, render_user_turn

__all__ = ["NOT_FOUND", "render_document", "render_user_turn"]
