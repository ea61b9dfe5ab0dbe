"""Render the README screenshot: the real app, real local ranks, a document attached, a question answered.

    python -m cpchat.tui.screenshot --all      # every picture the README and the docs show
    python -m cpchat.tui.screenshot [--model DIR] [--out assets/screenshot] [--size 100x30] [--panels]

Writes OUT.svg (app.save_screenshot) and OUT.png (via rsvg-convert or cairosvg, when installed).
`--panels` presses Ctrl+B first (on a narrow terminal: shows the side panels).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from cpchat.client.settings import REPO_ASSETS, Settings, bundled, resolve_model
from cpchat.dirs import new_user
from cpchat.tui.app import CpchatApp
from cpchat.tui.widgets import AttachmentChip, ChatInput, RanksPanel


async def capture(model: str, out: Path, document: Path, question: str, size: tuple[int, int],
                  panels: bool) -> None:
    from textual import events

    model_path, _ = resolve_model(model)
    app = CpchatApp(Settings(model=model, max_tokens=400, seed=7))
    async with app.run_test(size=size) as pilot:
        async def until(condition, timeout: float = 120.0) -> None:
            deadline = time.monotonic() + timeout
            while not condition():
                if time.monotonic() > deadline:
                    raise TimeoutError("screenshot: timed out")
                await pilot.pause(0.05)

        await until(lambda: app.chat.backend.session is not None)
        if panels:
            await pilot.press("ctrl+b")
        app.query_one(ChatInput).focus()
        app.post_message(events.Paste(f"'{document}'"))
        await until(lambda: any(c.tokens for c in app.query(AttachmentChip)))
        app.query_one(ChatInput).load_text(question)
        await pilot.press("enter")
        await until(lambda: app.chat.turns_done and not app.chat.busy)
        rows = app.query_one(RanksPanel).rows.values()
        await until(lambda: all(r.stats.state == "ready" for r in rows))  # the Stats stream lags a little
        await pilot.pause()
        app.query_one(ChatInput).cursor_blink = False
        svg = app.save_screenshot(filename=out.with_suffix(".svg").name, path=str(out.parent))
    png = str(out.with_suffix(".png"))
    if shutil.which("rsvg-convert"):
        subprocess.run(["rsvg-convert", "-z", "0.8", svg, "-o", png], check=True)
    else:
        try:
            import cairosvg
        except ImportError:
            return
        cairosvg.svg2png(url=svg, write_to=png, scale=0.8)


# Every picture the README and the docs show (docs/assets links to them): name, size, panels shown.
PICTURES = (("screenshot", (100, 30), False), ("screenshot-panels", (140, 40), False))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--all", action="store_true", help="render every picture the docs show, into assets/")
    p.add_argument("--model", default="")
    p.add_argument("--out", type=Path, default=REPO_ASSETS / "screenshot")
    p.add_argument("--doc", type=Path, default=bundled("sample-doc.txt"))
    p.add_argument("--question", default="What is the access code for the Orion vault?")
    p.add_argument("--size", default="100x30", help="terminal columns x rows")
    p.add_argument("--panels", action="store_true", help="press Ctrl+B first")
    args = p.parse_args()
    shots = [(REPO_ASSETS / name, size, panels) for name, size, panels in PICTURES] if args.all else \
        [(args.out, tuple(int(n) for n in args.size.split("x")), args.panels)]
    for out, size, panels in shots:
        # A new user's app each time: no saved conversation, panel choice or prefix cache
        os.environ.update(new_user(Path(tempfile.mkdtemp(prefix="cpchat-screenshot-"))))
        asyncio.run(capture(args.model, out, args.doc.resolve(), args.question, size, panels))


if __name__ == "__main__":
    main()
