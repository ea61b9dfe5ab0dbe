"""The modal screens over the chat, one a module; re-exported here."""

from cpchat.tui.screens.attachments import AttachmentsScreen, describe_document
from cpchat.tui.screens.context_budget import ContextBudget, MemoryBudget
from cpchat.tui.screens.conversations import ConversationsScreen
from cpchat.tui.screens.file_picker import FilePicker
from cpchat.tui.screens.help import HELP, HelpScreen
from cpchat.tui.screens.model_prompt import ModelPrompt

__all__ = [
    "HELP", "AttachmentsScreen", "ContextBudget", "ConversationsScreen", "FilePicker", "HelpScreen",
    "MemoryBudget", "ModelPrompt", "describe_document",
]
