"""The question a prompt too large for the model's context, or for the ranks' memory, asks before it
is sent."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, Label

from cpchat.client.memory import MemoryShortfall
from cpchat.format import human_bytes
from cpchat.tui.format import human_count


class PromptBudget(ModalScreen[str | None]):
    """A prompt too large: remove an attachment and send, send anyway (where that can work), or go
    back. Dismisses with "remove:<index>", "send" or None."""

    BINDINGS = [Binding("escape", "cancel", "Back")]

    def __init__(self, numbers: str, why: str, attachments: list[tuple[str, int | None]],
                 send_anyway: bool) -> None:
        super().__init__()
        self.numbers, self.why, self.attachments, self.send_anyway = numbers, why, attachments, send_anyway

    def compose(self) -> ComposeResult:
        with Vertical(id="budget-dialog"):
            yield Label(self.numbers, id="budget-numbers")
            yield Label(self.why, id="budget-why")
            with Vertical(id="budget-remove"):
                for i, (name, tokens) in enumerate(self.attachments):
                    size = f" ({human_count(tokens)} tok)" if tokens is not None else ""
                    yield Button(f"Remove {name}{size} and send", id=f"remove-{i}", compact=True)
            with Horizontal(id="budget-buttons"):
                if self.send_anyway:
                    yield Button("Send anyway", variant="warning", id="send", compact=True)
                yield Button("Back", id="back", compact=True)

    def on_button_pressed(self, event: Button.Pressed) -> None:
        event.stop()
        name = event.button.id or ""
        self.dismiss(name.replace("remove-", "remove:") if name.startswith(("send", "remove-")) else None)

    def action_cancel(self) -> None:
        self.dismiss(None)


class ContextBudget(PromptBudget):
    """The prompt is longer than the model's context."""

    def __init__(self, prompt_tokens: int, limit: int, attachments: list[tuple[str, int | None]]) -> None:
        super().__init__(f"This prompt is {prompt_tokens:,} tokens; the model's context is {limit:,}.",
                         "Past its context the model has not learned to attend: answers get unreliable, "
                         "and memory and time grow with every token.", attachments, send_anyway=True)


class MemoryBudget(PromptBudget):
    """Some rank cannot hold the prompt's prefill: sending it anyway could exhaust its machine's memory."""

    def __init__(self, shortfall: MemoryShortfall, attachments: list[tuple[str, int | None]]) -> None:
        need = shortfall.need
        hints = "".join(f"\n • {s}" for s in shortfall.suggestions)
        super().__init__(f"This prompt needs {human_bytes(need.total)} on {shortfall.label}, which has "
                         f"{human_bytes(need.free_bytes)} free.",
                         f"Not sent: past its free memory a machine swaps or kills the rank.{hints}",
                         attachments, send_anyway=False)
