"""The cpchat TUI: a shell around the chat screen (cpchat.tui.chat).

The app holds what is app-wide: styles, theme, help, the palette and the exit
status; the chat, its backend workers and its panels live on ChatScreen.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from textual.app import App
from textual.binding import Binding
from textual.screen import Screen

from cpchat import EXIT_USAGE
from cpchat.client.cluster import Cluster
from cpchat.client.connect import ClusterOptions
from cpchat.client.conversations import AmbiguousConversation, UnknownConversation, resume_path
from cpchat.client.settings import Settings, resolve_model, resolve_settings
from cpchat.dirs import data_dir
from cpchat.errors import BadInput
from cpchat.tui.chat import ChatScreen
from cpchat.tui.commands import palette
from cpchat.tui.screens import HelpScreen


class CpchatApp(App[int]):
    """Arguments go to the ChatScreen (see there); `exit_message` is printed after the app ends."""

    CSS_PATH = Path(__file__).with_name("app.tcss")
    TITLE = "cpchat"
    BINDINGS = [Binding("f1", "help", "Help")]
    CHAT_SCREEN: type[ChatScreen] = ChatScreen  # tests observe the chat through a subclass

    def __init__(
        self,
        settings: Settings,
        options: ClusterOptions | None = None,
        *,
        cluster: Cluster | None = None,
        model_path: str | None = None,
        resume: Path | None = None,
        start_backend: bool = True,
        transcripts: Path | None = None,
    ) -> None:
        super().__init__()
        self.settings = settings
        self.exit_message = ""
        self._chat_arguments = dict(options=options, cluster=cluster, model_path=model_path, resume=resume,
                                    start_backend=start_backend, transcripts=transcripts)
        self._chat: ChatScreen | None = None

    @property
    def chat(self) -> ChatScreen:
        assert self._chat is not None, "the app is not running"
        return self._chat

    def get_default_screen(self) -> Screen:
        """Made here, not in __init__: widgets are built inside the running app."""
        self._chat = self.CHAT_SCREEN(self.settings, **self._chat_arguments)
        return self._chat

    def on_mount(self) -> None:
        if self.settings.theme in self.available_themes:
            self.theme = self.settings.theme

    def get_system_commands(self, screen: Screen):
        yield from super().get_system_commands(screen)
        yield from palette(self.chat)

    def action_help(self) -> None:
        self.push_screen(HelpScreen())


def run_app(args: argparse.Namespace, options: ClusterOptions) -> int:
    """The TUI entry point: 0 on a normal quit, 2 on bad input, 3 when the backend fails at startup."""
    try:
        settings = resolve_settings(args)
        resolve_model(settings.model)  # a bad model path fails before the screen opens
        resume = resume_path(data_dir() / "transcripts", args.resume) if args.resume else None
    except (BadInput, UnknownConversation, AmbiguousConversation) as e:
        print(f"cpchat: {e}", file=sys.stderr)
        return EXIT_USAGE
    if args.resume and resume is None:
        print(f"cpchat: no saved conversation to resume in {data_dir() / 'transcripts'}", file=sys.stderr)
        return EXIT_USAGE
    app = CpchatApp(settings, options, resume=resume)
    code = app.run()
    if app.exit_message:
        print(f"cpchat: {app.exit_message}", file=sys.stderr)
    return app.return_code if app.return_code is not None else (code or 0)
