"""The question a prompt past the model's context asks before it is sent."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, Label

from cpchat.tui.format import human_count


class ContextBudget(ModalScreen[str | None]):
    """The prompt is longer than the model's context: remove an attachment and send, send anyway, or
    go back. Dismisses with "remove:<index>", "send" or None."""

    BINDINGS = [Binding("escape", "cancel", "Back")]

    def __init__(self, prompt_tokens: int, limit: int, attachments: list[tuple[str, int | None]]) -> None:
        super().__init__()
        self.prompt_tokens, self.limit, self.attachments = prompt_tokens, limit, attachments

    def compose(self) -> ComposeResult:
        with Vertical(id="budget-dialog"):
            yield Label(f"This prompt is {self.prompt_tokens:,} tokens; the model's context is "
                        f"{self.limit:,}.", id="budget-numbers")
            yield Label("Past its context the model has not learned to attend: answers get unreliable, "
                        "and memory and time grow with every token.", id="budget-why")
            with Vertical(id="budget-remove"):
                for i, (name, tokens) in enumerate(self.attachments):
                    size = f" ({human_count(tokens)} tok)" if tokens is not None else ""
                    yield Button(f"Remove {name}{size} and send", id=f"remove-{i}", compact=True)
            with Horizontal(id="budget-buttons"):
                yield Button("Send anyway", variant="warning", id="send", compact=True)
                yield Button("Back", id="back", compact=True)

    def on_button_pressed(self, event: Button.Pressed) -> None:
        event.stop()
        name = event.button.id or ""
        self.dismiss(name.replace("remove-", "remove:") if name.startswith(("send", "remove-")) else None)

    def action_cancel(self) -> None:
        self.dismiss(None)
