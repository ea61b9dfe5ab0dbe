"""The modal screens over the chat, one a module; re-exported here."""

from cpchat.tui.screens.attach_typed import AttachTyped
from cpchat.tui.screens.attachments import AttachmentsScreen, describe_document
from cpchat.tui.screens.context_budget import ContextBudget, MemoryBudget
from cpchat.tui.screens.conversations import ConversationsScreen
from cpchat.tui.screens.file_picker import FilePicker
from cpchat.tui.screens.help import HELP, HelpScreen
from cpchat.tui.screens.model_picker import ModelPicker

__all__ = [
    "HELP", "AttachTyped", "AttachmentsScreen", "ContextBudget", "ConversationsScreen", "FilePicker",
    "HelpScreen", "MemoryBudget", "ModelPicker", "describe_document",
]
