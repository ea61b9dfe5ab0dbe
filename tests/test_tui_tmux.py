"""The real `cpchat` in a real terminal (tmux): start, answer, show the ranks, quit clean."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from rankprocs import ranks_started_with

from cpchat.client.settings import bundled
from cpchat.dirs import new_user

pytestmark = [pytest.mark.skipif(shutil.which("tmux") is None, reason="needs tmux"), pytest.mark.slow]


class Tmux:
    def __init__(self, socket: str) -> None:
        self.socket = socket

    def __call__(self, *args: str) -> str:
        return subprocess.run(["tmux", "-L", self.socket, *args], check=True, capture_output=True,
                              text=True).stdout

    def screen(self) -> str:
        return self("capture-pane", "-p", "-t", "main")

    def wait_for(self, condition, timeout: float, what: str) -> str:
        deadline = time.monotonic() + timeout
        while True:
            text = self.screen()
            if condition(text):
                return text
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {what}; screen:\n{text}")
            time.sleep(0.2)


def rank_processes(root: int) -> list[psutil.Process]:
    """`cpchat rank` processes launched (via --parent-pid) by a process under the tmux pane."""
    try:
        family = {root} | {p.pid for p in psutil.Process(root).children(recursive=True)}
    except psutil.NoSuchProcess:
        return []
    return ranks_started_with("--parent-pid", lambda value: int(value) in family)


def terminal_env(home: Path) -> dict[str, str]:
    """The environment of a user who never ran cpchat (what earlier tests saved is not theirs), in a
    terminal of tmux's size."""
    # COLUMNS and LINES (pytest-xdist's workers set 80 x 24) would override the size Textual reads from tmux
    inherited = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    return {**inherited, **new_user(home), "TERM": "xterm-256color"}


def kv_tokens(screen: str) -> list[int]:
    return [int(n) for n in re.findall(r"KV [^\d\n]*(\d+) tok", screen)]


def test_cpchat_runs_in_tmux(model_dir, tmp_path):
    model = model_dir("llama")
    tmux = Tmux(f"cpchat-test-{os.getpid()}")
    command = " ".join(shlex.quote(a) for a in [sys.executable, "-m", "cpchat", "--model", str(model),
                                                 "--ranks", "2", "--max-tokens", "8"])
    env = terminal_env(tmp_path)
    subprocess.run(["tmux", "-L", tmux.socket, "-f", "/dev/null", "new-session", "-d", "-s", "main",
                    "-x", "140", "-y", "44", f"{command}; echo EXIT=$?; sleep 60"], check=True, env=env)
    try:
        pane_pid = int(tmux("list-panes", "-t", "main", "-F", "#{pane_pid}").split()[0])
        tmux.wait_for(lambda s: "2 ranks" in s and len(kv_tokens(s)) == 2, 90, "the ranks to be ready")
        ranks = rank_processes(pane_pid)
        assert len(ranks) == 2
        tmux("send-keys", "-t", "main", "-l", "Hello there")
        tmux("send-keys", "-t", "main", "Enter")
        screen = tmux.wait_for(lambda s: "Assistant" in s and all(n > 0 for n in kv_tokens(s))
                               and "TTFT" in s and re.search(r"TTFT\s+[\d,.]+ ms", s), 90, "an answer")
        assert "You" in screen and "Hello there" in screen
        assert len(re.findall(r"127\.0\.0\.1:\d+\s+(?:ready|busy|idle)", screen)) == 2
        tmux("send-keys", "-t", "main", "C-q")
        tmux.wait_for(lambda s: "EXIT=" in s, 30, "cpchat to quit")
        assert "EXIT=0" in tmux.screen()
        gone, alive = psutil.wait_procs(ranks, timeout=10)
        assert not alive, f"rank processes left behind: {[p.pid for p in alive]}"
    finally:
        subprocess.run(["tmux", "-L", tmux.socket, "kill-server"], capture_output=True)


def test_a_typed_path_and_a_question_are_answered_from_the_document(tmp_path):
    """The first minute with the demo model: type a document's path and a question, take the offer to
    attach it, and read the answer out of the document."""
    doc = tmp_path / "notes on vaults.txt"
    doc.write_text(bundled("sample-doc.txt").read_text(encoding="utf-8"))
    tmux = Tmux(f"cpchat-typed-{os.getpid()}")
    command = shlex.join([sys.executable, "-m", "cpchat", "--ranks", "2", "--max-tokens", "24"])
    env = terminal_env(tmp_path)
    subprocess.run(["tmux", "-L", tmux.socket, "-f", "/dev/null", "new-session", "-d", "-s", "main",
                    "-x", "140", "-y", "44", f"{command}; echo EXIT=$?; sleep 60"], check=True, env=env)
    try:
        tmux.wait_for(lambda s: "demo-model on 2 ranks" in s, 90, "the welcome to name the model")
        question = "What is the access code for the Orion vault?"
        tmux("send-keys", "-t", "main", "-l", f"{shlex.quote(str(doc))} {question}")
        tmux("send-keys", "-t", "main", "Enter")
        tmux.wait_for(lambda s: re.search(r"Attach notes on vaults\.txt \([\d.,k]+ tok\) and send\?", s), 60,
                      "the offer to attach")
        tmux("send-keys", "-t", "main", "Enter")
        screen = tmux.wait_for(lambda s: "4812-KX" in s, 120, "the answer from the document")
        assert "attached: notes on vaults.txt" in screen
        assert "cpchat · chat about long documents" not in screen, "the welcome left with the turn"
        tmux("send-keys", "-t", "main", "C-q")
        tmux.wait_for(lambda s: "EXIT=" in s, 30, "cpchat to quit")
        assert "EXIT=0" in tmux.screen()
    finally:
        subprocess.run(["tmux", "-L", tmux.socket, "kill-server"], capture_output=True)
