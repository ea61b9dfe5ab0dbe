"""The chat's one command table: every command is reachable as /name, in the palette, and names a
real action."""

from __future__ import annotations

from cpchat.tui.app import CpchatApp
from cpchat.tui.chat import ChatScreen
from cpchat.tui.commands import BY_NAME, COMMANDS, parse_slash


def test_slash_commands_parse_with_and_without_their_argument():
    assert parse_slash("/model acme/tiny-chat") == (BY_NAME["model"], "acme/tiny-chat")
    assert parse_slash("/attach  'a b.pdf' c.txt ") == (BY_NAME["attach"], "'a b.pdf' c.txt")
    assert parse_slash("/clear") == (BY_NAME["clear"], "")
    assert parse_slash("/nosuch thing") is None  # sent as a prompt
    assert parse_slash("clear") is None


def test_every_command_names_an_action_that_exists():
    for command in COMMANDS:
        owner, _, name = command.action.rpartition(".")
        assert hasattr(CpchatApp if owner == "app" else ChatScreen, f"action_{name}"), command.name
