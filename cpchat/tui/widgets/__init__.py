"""One widget per module; re-exported here for the app."""

from cpchat.tui.widgets.attachments import AttachmentBar, AttachmentChip
from cpchat.tui.widgets.chat_input import ChatInput
from cpchat.tui.widgets.ranks import RankRow, RanksPanel
from cpchat.tui.widgets.ring import BigText, RingPanel
from cpchat.tui.widgets.status_strip import StatusStrip
from cpchat.tui.widgets.throughput import ThroughputPanel
from cpchat.tui.widgets.transcript import ChatMessage, Transcript
from cpchat.tui.widgets.work_bar import WorkBar

__all__ = [
    "AttachmentBar", "AttachmentChip", "BigText", "ChatInput", "ChatMessage", "RankRow", "RanksPanel",
    "RingPanel", "StatusStrip", "ThroughputPanel", "Transcript", "WorkBar",
]
