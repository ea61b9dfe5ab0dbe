"""The model to switch every rank to (/model without one)."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import Input, Label


class ModelPrompt(ModalScreen[str | None]):
    """Asks for the model to switch to (a directory, hub id, GGUF file, ollama:NAME or smollm2);
    dismisses with it or None."""

    BINDINGS = [Binding("escape", "cancel", "Back")]

    def __init__(self, current: str) -> None:
        super().__init__()
        self.current = current

    def compose(self) -> ComposeResult:
        with Vertical(id="model-dialog"):
            yield Label(f"Switch every rank from {self.current} to (the conversation stays):")
            yield Input(placeholder="a model directory, ORG/NAME[@rev], FILE.gguf, ollama:NAME or smollm2",
                        id="model-input")

    def on_input_submitted(self, event: Input.Submitted) -> None:
        event.stop()
        self.dismiss(event.value.strip() or None)

    def action_cancel(self) -> None:
        self.dismiss(None)
