"""One widget per module; re-exported here for the chat screen."""

from cpchat.tui.widgets.answer import Answer
from cpchat.tui.widgets.attachment_bar import AttachmentBar
from cpchat.tui.widgets.attachment_chip import AttachmentChip
from cpchat.tui.widgets.big_text import BigText
from cpchat.tui.widgets.chat_input import ChatInput
from cpchat.tui.widgets.chat_message import ChatMessage
from cpchat.tui.widgets.rank_row import RankRow
from cpchat.tui.widgets.ranks import RanksPanel
from cpchat.tui.widgets.ring import RingPanel
from cpchat.tui.widgets.ring_chart import RingChart
from cpchat.tui.widgets.side_panels import SidePanels
from cpchat.tui.widgets.stage_map import StageMap
from cpchat.tui.widgets.status_strip import StatusStrip
from cpchat.tui.widgets.throughput import ThroughputPanel
from cpchat.tui.widgets.transcript import Transcript
from cpchat.tui.widgets.welcome import Welcome
from cpchat.tui.widgets.work_bar import WorkBar

__all__ = [
    "Answer", "AttachmentBar", "AttachmentChip", "BigText", "ChatInput", "ChatMessage", "RankRow",
    "RanksPanel", "RingChart", "RingPanel", "SidePanels", "StageMap", "StatusStrip", "ThroughputPanel",
    "Transcript", "Welcome", "WorkBar",
]
