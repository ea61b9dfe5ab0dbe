"""One table of the chat's commands: the palette lists them, `/name [argument]` runs them, and
each is an `action_*` of ChatScreen, called directly (a key binding's check_action, which hides
Ctrl+R until a rank fails, does not hide the command)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from textual.app import SystemCommand
from textual.screen import Screen

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
    Command("model", "Switch model", "Pick a model on this machine for every rank; the conversation stays",
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


def run_command(screen: Screen, command: Command, argument: str = "") -> None:
    """Call the command's action on the chat screen (or the app), with the argument if it takes one."""
    owner, _, name = command.action.rpartition(".")
    action = getattr(screen.app if owner == "app" else screen, f"action_{name}")
    if argument and command.argument:
        action(argument)
    else:
        action()


def run_slash(screen: Screen, text: str) -> bool:
    """Run `/name [argument]`; False when it names no command (then it is a prompt)."""
    parsed = parse_slash(text)
    if parsed is not None:
        run_command(screen, *parsed)
    return parsed is not None


def palette(screen: Screen) -> Iterator[SystemCommand]:
    """The palette's entries (the app adds Textual's own). The palette takes no argument, so the
    algorithm has one entry per choice."""
    for command in COMMANDS:
        if command.name == "algorithm":
            for algorithm in ALGORITHMS:
                yield SystemCommand(f"Algorithm: {algorithm}", f"Use {algorithm} for the ring from the "
                                    "next turn", lambda c=command, a=algorithm: run_command(screen, c, a))
        else:
            yield SystemCommand(command.title, command.help, lambda c=command: run_command(screen, c))
