"""A word in three-row block letters: the Ring panel's algorithm, readable from across the room."""

from __future__ import annotations

from rich.text import Text
from textual.reactive import reactive
from textual.widget import Widget

# A three-row block font for the few letters the algorithm names need.
GLYPHS = {
    "P": ("┏━┓", "┣━┛", "╹  "),
    "A": ("┏━┓", "┣━┫", "╹ ╹"),
    "S": ("┏━╸", "┗━┓", "╺━┛"),
    "K": ("╻┏╸", "┣┻┓", "╹ ╹"),
    "V": ("╻  ╻", "┗┓┏┛", " ┗┛ "),
    "Q": ("┏━┓", "┃ ┃", "┗━╋"),
    "U": ("╻ ╻", "┃ ┃", "┗━┛"),
    "T": ("╺┳╸", " ┃ ", " ╹ "),
    "O": ("┏━┓", "┃ ┃", "┗━┛"),
    "L": ("╻  ", "┃  ", "┗━╸"),
    "G": ("┏━╸", "┃╺┓", "┗━┛"),
    "H": ("╻ ╻", "┣━┫", "╹ ╹"),
    "E": ("┏━╸", "┣╸ ", "┗━╸"),
    "R": ("┏━┓", "┣┳┛", "╹┗╸"),
    "Y": ("╻ ╻", "┗┳┛", " ╹ "),
    "-": ("   ", "╺━╸", "   "),
    " ": ("   ", "   ", "   "),
}


class BigText(Widget):
    """A word in three-row block letters (unknown letters become blanks)."""

    text: reactive[str] = reactive("")

    def render(self) -> Text:
        word = self.text.upper().replace("_", "-")
        rows = [" ".join(GLYPHS.get(ch, GLYPHS[" "])[i] for ch in word) for i in range(3)]
        return Text("\n".join(rows), style="bold")
