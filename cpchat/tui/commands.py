"""One table of the chat's commands: the palette lists them, `/name [argument]` runs them, and
each is an `action_*` of ChatScreen, called directly (a key binding's check_action, which hides
Ctrl+R until a rank fails, does not hide the command)."""

from __future__ import annotations

from dataclasses import dataclass

from cpchat.core.algorithms import ALGORITHMS


@dataclass(frozen=True)
class Command:
    name: str  # typed as /name
    title: str  # in the palette
    help: str
    action: str  # ChatScreen.action_<action>; "app.help" for the app's
    argument: str = ""  # what /name takes after it ("" for nothing); without it the action asks


COMMANDS = (
    Command("attach", "Attach file", "Pick a document to include in the next message", "attach_file",
            "PATH [PATH…]"),
    Command("attachments", "List attachments", "What goes into the next message, a folder's files too",
            "list_attachments"),
    Command("conversations", "Conversations", "Open, rename or delete a saved conversation", "conversations"),
    Command("model", "Switch model", "Load another model on every rank; the conversation stays",
            "switch_model", "PATH_OR_ID"),
    Command("algorithm", "Ring algorithm", "auto, pass_kv, pass_q, all_gather or ulysses from the next turn",
            "set_algorithm", "|".join(ALGORITHMS)),
    Command("clear", "Clear conversation", "Forget the conversation and the ranks' KV cache", "clear"),
    Command("export", "Export transcript", "Save the conversation as Markdown", "export"),
    Command("relaunch", "Relaunch ranks", "Start fresh local ranks and re-read the conversation", "relaunch"),
    Command("help", "Show help", "Keys, attachments and panels", "app.help"),
)
BY_NAME = {c.name: c for c in COMMANDS}


def parse_slash(text: str) -> tuple[Command, str] | None:
    """The command and its argument in `/name argument`, or None when it names no command."""
    name, _, argument = text.removeprefix("/").partition(" ")
    command = BY_NAME.get(name)
    return (command, argument.strip()) if command is not None and text.startswith("/") else None
