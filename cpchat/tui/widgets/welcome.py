"""What an empty conversation shows: what this is, which model runs where, how to attach a document
and the keys that matter. It leaves with the first turn and comes back when the conversation is
cleared."""

from __future__ import annotations

from textual.content import Content
from textual.reactive import reactive
from textual.widgets import Static


class Welcome(Static):
    """`model` and `ranks` are empty until the ranks are ready; `sample` is a document to try the demo
    model on ("" for another model)."""

    model: reactive[str] = reactive("")
    ranks: reactive[int] = reactive(0)
    sample: reactive[str] = reactive("")

    def on_mount(self) -> None:
        self.update(self.text())

    def watch_model(self) -> None:
        self.update(self.text())

    def watch_ranks(self) -> None:
        self.update(self.text())

    def watch_sample(self) -> None:
        self.update(self.text())

    def text(self) -> Content:
        running = (Content.from_markup("[b]$model[/b] on $ranks, each holding a share of the context.",
                                       model=self.model, ranks=f"{self.ranks} rank{'s' * (self.ranks != 1)}")
                   if self.model else Content("Starting the ranks…"))
        title = Content.from_markup("[b $accent]cpchat[/] · chat about long documents")
        lines = [title, running, Content("")]
        if self.sample:
            lines += [
                Content("The demo model is tiny: it answers questions such as this one about a document you "
                        "attach (type it: the path, then the question):"),
                Content.from_markup("  [$accent]$sample What is the access code for the Orion vault?[/]",
                                    sample=self.sample),
                Content.from_markup("For real answers run a real model: [b]/model[/b] lists those on this "
                                    "machine."),
                Content(""),
            ]
        lines += [
            Content.from_markup("[b]Attach a document[/b]: drop it onto the terminal, paste or type its path "
                                "before your question, [b]/attach PATH[/b] or [b]Ctrl+O[/b]."),
            Content.from_markup("[b]Enter[/b] sends · [b]Esc[/b] stops the answer · [b]Ctrl+P[/b] commands · "
                                "[b]F1[/b] help"),
        ]
        return Content("\n").join(lines)
