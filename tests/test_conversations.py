"""Saved conversations: listing, renaming, deleting and finding them by id, and `cpchat --list`.

Files are written the way the app writes them (TranscriptStore.add, delta, usage, end, flush), and
one the way cpchat wrote them before model names and token counts were recorded.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cpchat.cli import app_parser, main
from cpchat.client.conversations import (
    RESUME_LAST,
    AmbiguousConversation,
    ConversationSummary,
    UnknownConversation,
    delete_conversation,
    estimate_tokens,
    find_conversation,
    list_conversations,
    rename_conversation,
    resume_path,
)
from cpchat.client.transcripts import BIG_LINE, Entry, TranscriptStore

DAY = 86_400
ROOT = Path(__file__).resolve().parents[1]
T0 = 1_700_000_000  # 2023-11-14: every file gets an explicit time, so order never depends on timing


def set_time(path: Path, t: float) -> None:
    os.utime(path, (t, t))


def write_chat(directory: Path, name: str, turns: list[tuple[str, str]], *, model: str = "",
               usage: list[tuple[int, int]] | None = None, docs: list[str] | None = None,
               t: float = T0) -> Path:
    """A conversation as the app saves it: the user's entry, the answer streamed in pieces, the
    ranks' counts for the turn, the end mark."""
    store = TranscriptStore(directory, directory / f"{name}.jsonl")
    if model:
        store.set_model(model)
    for i, (question, answer) in enumerate(turns):
        attached = docs if i == 0 and docs else []
        content = "".join(f"<document {d}>\n...\n</document>\n\n" for d in attached) + question
        store.add(Entry("user", question, content, attached))
        for k in range(0, len(answer), 3):
            store.delta(answer[k:k + 3])
        if usage is not None and i < len(usage):
            store.usage(*usage[i])
        store.end()
    store.flush()
    set_time(store.path, t)
    return store.path


def write_old_format(directory: Path, name: str, t: float = T0) -> Path:
    """The bytes cpchat wrote before this change: no meta, no usage lines."""
    records = [
        {"role": "user", "text": "Résumé the report", "content": "<document r.txt>\n" + "x" * 400
         + "\n</document>\n\nRésumé the report", "docs": ["r.txt"]},
        {"role": "assistant", "delta": "It is "},
        {"role": "assistant", "delta": "about cats."},
        {"end": True},
    ]
    path = directory / f"{name}.jsonl"
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")
    set_time(path, t)
    return path


@pytest.fixture
def chats(tmp_path) -> Path:
    """A transcripts folder holding new, old, documents-only, empty-ish and corrupt files."""
    d = tmp_path / "transcripts"
    d.mkdir()
    write_chat(d, "20231114-100000-11", [("What is in the report?", "A summary."),
                                          ("And the\nconclusion?", "Cats win.")],
               model="/models/Qwen3-4B-4bit", usage=[(50, 7), (120, 9)], t=T0 + 3 * DAY)
    write_old_format(d, "20231113-090000-22", t=T0 + 2 * DAY)
    write_chat(d, "20231112-080000-33", [("", "Noted.")], model="org/Tiny@main", docs=["a.txt", "b.md"],
               usage=[(300, 2)], t=T0 + DAY)
    (d / "20231111-070000-44.jsonl").write_bytes(b"\x00\xff not json at all\n\x89PNG garbage\n")
    set_time(d / "20231111-070000-44.jsonl", T0)
    (d / "notes.txt").write_text("not a transcript")
    (d / "folder.jsonl").mkdir()
    return d


def by_id(summaries: list[ConversationSummary]) -> dict[str, ConversationSummary]:
    return {s.id: s for s in summaries}


# ---- listing


def test_listing_is_newest_first_and_starts_with_what_resume_opens(chats):
    ids = [s.id for s in list_conversations(chats)]
    assert ids == ["20231114-100000-11", "20231113-090000-22", "20231112-080000-33", "20231111-070000-44"]
    assert list_conversations(chats)[0].path == TranscriptStore.last(chats)
    set_time(chats / "20231111-070000-44.jsonl", T0 + 9 * DAY)
    assert list_conversations(chats)[0].id == "20231111-070000-44"


def test_ties_in_time_are_ordered_as_resume_picks(tmp_path):
    for name in ("a", "a-b", "b"):
        write_chat(tmp_path, name, [(name, "ok")], t=T0)
    listed = list_conversations(tmp_path)
    assert listed[0].path == TranscriptStore.last(tmp_path)
    assert [s.id for s in listed] == ["b", "a", "a-b"]  # by file name, as TranscriptStore.last breaks ties


def test_summary_of_a_conversation_saved_with_model_and_counts(chats):
    s = by_id(list_conversations(chats))["20231114-100000-11"]
    assert s.title == "What is in the report?"
    assert s.model == "/models/Qwen3-4B-4bit"
    assert s.messages == 4
    assert (s.tokens, s.tokens_estimated) == (129, False)  # the last turn's prompt + answer
    assert s.updated.timestamp() == T0 + 3 * DAY
    assert s.path == chats / "20231114-100000-11.jsonl" and s.error == ""


def test_old_format_file_still_loads_and_lists(chats):
    path = chats / "20231113-090000-22.jsonl"
    entries = TranscriptStore.load(path)
    assert [(e.role, e.text) for e in entries] == [("user", "Résumé the report"),
                                                   ("assistant", "It is about cats.")]
    s = by_id(list_conversations(chats))["20231113-090000-22"]
    assert (s.title, s.model, s.messages) == ("Résumé the report", "", 2)
    # ~440 characters of content: an estimate, labelled as one, of the right size
    assert s.tokens_estimated and 80 <= s.tokens <= 160


def test_documents_only_first_turn_is_titled_by_its_documents(chats):
    s = by_id(list_conversations(chats))["20231112-080000-33"]
    assert s.title.startswith("(documents only") and "a.txt" in s.title
    assert (s.model, s.tokens, s.tokens_estimated) == ("org/Tiny@main", 302, False)


def test_corrupt_file_is_listed_as_unreadable_and_others_are_skipped(chats):
    summaries = list_conversations(chats)
    s = by_id(summaries)["20231111-070000-44"]
    assert s.title.startswith("(unreadable") and s.error and s.messages == 0
    assert "notes" not in by_id(summaries) and "folder" not in by_id(summaries)


def test_long_multiline_title_is_one_line_of_sixty(tmp_path):
    write_chat(tmp_path, "long", [("first line\n\n  second   line " + "word " * 30, "ok")])
    title = list_conversations(tmp_path)[0].title
    assert title.startswith("first line second line word") and "\n" not in title
    assert len(title) == 60 and title.endswith("…")


def test_empty_and_torn_files(tmp_path):
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "torn.jsonl").write_text('{"role": "user", "te')  # a crash during the first write
    s = by_id(list_conversations(tmp_path))
    assert (s["empty"].title, s["empty"].messages, s["empty"].tokens) == ("(empty)", 0, 0)
    assert s["torn"].messages == 0  # listed, not fatal
    assert list_conversations(tmp_path / "missing") == []


def test_turn_without_counts_after_counted_ones_makes_an_estimate(tmp_path):
    path = write_chat(tmp_path, "c", [("one", "two"), ("three " * 40, "four")], usage=[(30, 2)])
    s = list_conversations(tmp_path)[0]
    assert s.tokens_estimated and s.tokens > 32  # 32 counted, the second turn guessed on top
    assert [e.text for e in TranscriptStore.load(path)][:2] == ["one", "two"]


def test_long_documents_are_summarized_as_read_in_full(tmp_path):
    """A summary skims message lines past BIG_LINE and answers' deltas; it must agree with a full read."""
    doc = 'He said "stop" \\ then\n\tleft. Ünïcödé \u2028 line\x85sep {"x": [1]} ' * (3 * BIG_LINE // 50)
    store = TranscriptStore(tmp_path, tmp_path / "big.jsonl")
    store.add(Entry("user", "", f"<document a.txt>\n{doc}\n</document>", ["a.txt", 'q"uote.md']))
    for piece in ('Sure: "', "it\u2028", 'rambles"} ', "on.\\"):
        store.delta(piece)
    store.end()
    store.add(Entry("user", 'Is "that" all?', doc + "?", []))
    store.delta("Yes.")
    store.end()
    store.flush()
    entries = TranscriptStore.load(store.path)
    assert [e.text for e in entries] == ["", 'Sure: "it\u2028rambles"} on.\\', 'Is "that" all?', "Yes."]
    assert entries[0].content.endswith(doc + "\n</document>") and entries[0].docs == ["a.txt", 'q"uote.md']
    s = list_conversations(tmp_path)[0]
    assert s.messages == 4 and s.title == "(documents only: a.txt, q\"uote.md)"
    exact = estimate_tokens([len(e.content) for e in entries])
    assert s.tokens_estimated and abs(s.tokens - exact) < 0.02 * exact


def test_unusual_line_separators_stay_inside_their_message(tmp_path):
    store = TranscriptStore(tmp_path)
    text = "a\u2028b\u2029c\x85d\x0be\x1cf\rg"
    store.add(Entry("user", text))
    store.delta(text)
    store.end()
    store.flush()
    assert [e.text for e in TranscriptStore.load(store.path)] == [text, text]
    assert list_conversations(tmp_path)[0].messages == 2


# ---- what the store records


def test_model_is_written_once_per_file_and_only_with_a_message(tmp_path):
    store = TranscriptStore(tmp_path)
    store.set_model("m1")
    store.flush()
    assert not store.path.exists()  # an idle start leaves no file
    store.add(Entry("user", "hi"))
    store.delta("hello")
    store.usage(10, 1)
    store.end()
    store.add(Entry("user", "again"))
    store.flush()
    records = [json.loads(line) for line in store.path.read_text().splitlines()]
    assert records[0] == {"meta": {"model": "m1"}}
    assert sum("meta" in r for r in records) == 1
    assert {"usage": {"prompt_tokens": 10, "generated_tokens": 1}} in records
    assert [(e.role, e.text) for e in TranscriptStore.load(store.path)] == [
        ("user", "hi"), ("assistant", "hello"), ("user", "again")]

    store.set_model("m2")  # relaunched on another model: the newest wins
    store.add(Entry("user", "third"))
    store.flush()
    assert list_conversations(tmp_path)[0].model == "m2"

    first = store.path
    store.clear()
    store.add(Entry("user", "new conversation"))
    store.flush()
    assert store.path != first
    assert json.loads(store.path.read_text().splitlines()[0]) == {"meta": {"model": "m2"}}


def test_appending_after_a_torn_line_keeps_the_new_message(tmp_path):
    path = write_old_format(tmp_path, "crashed")
    with open(path, "a") as f:
        f.write('{"role": "assistant", "del')  # torn by a crash
    store = TranscriptStore(tmp_path, path)  # resumed
    store.add(Entry("user", "still there?"))
    store.flush()
    assert [e.text for e in TranscriptStore.load(path)][-1] == "still there?"


# ---- rename, delete, find


def test_rename_changes_the_title_only(chats):
    path = chats / "20231113-090000-22.jsonl"
    before = TranscriptStore.load(path)
    order = [s.id for s in list_conversations(chats)]
    renamed = rename_conversation(chats, "20231113-090000-22", "  Cats\nreport ")
    assert renamed.title == "Cats report"
    assert by_id(list_conversations(chats))["20231113-090000-22"].title == "Cats report"
    assert TranscriptStore.load(path) == before
    assert path.stat().st_mtime == T0 + 2 * DAY  # not made the newest: --resume still opens the same one
    assert [s.id for s in list_conversations(chats)] == order
    rename_conversation(chats, "20231113-090000-22", "Again")
    assert by_id(list_conversations(chats))["20231113-090000-22"].title == "Again"
    rename_conversation(chats, "20231113-090000-22", "")
    assert by_id(list_conversations(chats))["20231113-090000-22"].title == "Résumé the report"


def test_rename_after_a_torn_line(tmp_path):
    path = write_old_format(tmp_path, "crashed")
    with open(path, "a") as f:
        f.write('{"role": "assistant", "del')
    assert rename_conversation(tmp_path, "crashed", "Named").title == "Named"


def test_delete_removes_it(chats):
    removed = delete_conversation(chats, "20231112")  # a unique prefix
    assert removed == chats / "20231112-080000-33.jsonl" and not removed.exists()
    assert "20231112-080000-33" not in by_id(list_conversations(chats))
    with pytest.raises(UnknownConversation):
        delete_conversation(chats, "20231112-080000-33")


def test_find_by_id_or_unique_prefix(chats):
    assert find_conversation(chats, "20231114-100000-11") == chats / "20231114-100000-11.jsonl"
    assert find_conversation(chats, "20231113") == chats / "20231113-090000-22.jsonl"
    write_chat(chats, "20231113", [("exact", "match")])
    assert find_conversation(chats, "20231113") == chats / "20231113.jsonl"  # an exact id beats prefixes


def test_unknown_id_is_a_clear_error(chats):
    for bad in ("nope", "", "2099"):
        with pytest.raises(UnknownConversation) as e:
            find_conversation(chats, bad)
        assert isinstance(e.value, ValueError)
        assert repr(bad) in str(e.value) and "cpchat --list" in str(e.value)
    for call in (lambda: rename_conversation(chats, "nope", "x"), lambda: delete_conversation(chats, "nope")):
        with pytest.raises(UnknownConversation):
            call()
    with pytest.raises(UnknownConversation):
        find_conversation(chats / "missing", "x")


def test_ambiguous_prefix_names_the_candidates(chats):
    with pytest.raises(AmbiguousConversation) as e:
        find_conversation(chats, "202311")
    assert isinstance(e.value, ValueError)
    assert "20231114-100000-11" in str(e.value) and "20231112-080000-33" in str(e.value)
    assert set(e.value.candidates) == {"20231114-100000-11", "20231113-090000-22", "20231112-080000-33",
                                       "20231111-070000-44"}
    with pytest.raises(AmbiguousConversation):
        delete_conversation(chats, "2023111")
    assert len(list_conversations(chats)) == 4


def test_resume_path(chats, tmp_path):
    assert resume_path(chats, RESUME_LAST) == chats / "20231114-100000-11.jsonl"
    assert resume_path(chats, "20231112") == chats / "20231112-080000-33.jsonl"
    assert resume_path(tmp_path / "missing", RESUME_LAST) is None
    with pytest.raises(UnknownConversation):
        resume_path(chats, "nope")


# ---- the command line


def test_resume_flag():
    parse = app_parser().parse_args
    assert not parse([]).resume
    assert parse(["--resume"]).resume == RESUME_LAST
    assert parse(["--resume", "--headless"]).resume == RESUME_LAST
    assert parse(["--resume", "20231113"]).resume == "20231113"
    assert parse(["--list"]).list and not parse([]).list


@pytest.fixture
def data_home(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    return tmp_path / "data" / "cpchat" / "transcripts"


def test_list_prints_an_aligned_table_newest_first(data_home, chats, capsys, monkeypatch):
    import cpchat.client.cluster as cluster

    monkeypatch.setattr(cluster.Cluster, "launch", lambda *a, **k: pytest.fail("--list started ranks"))
    data_home.parent.mkdir(parents=True)
    chats.rename(data_home)
    assert main(["--list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["ID", "UPDATED", "MODEL", "TOKENS", "MSGS", "TITLE"]
    assert [line.split()[0] for line in lines[1:]] == [
        "20231114-100000-11", "20231113-090000-22", "20231112-080000-33", "20231111-070000-44"]
    first = lines[1]
    assert "Qwen3-4B-4bit" in first and "129" in first and "What is in the report?" in first
    assert "~" in lines[2] and " - " in lines[2]  # old file: estimated tokens, no model
    title_at = lines[0].index("TITLE")
    assert lines[1][title_at:] == "What is in the report?"
    assert lines[2][title_at:] == "Résumé the report"
    tokens_end = lines[0].index("TOKENS") + len("TOKENS")
    assert lines[1][:tokens_end].endswith("129")  # numbers right-aligned under their heading


def test_list_when_nothing_is_saved(data_home, capsys):
    assert main(["--list"]) == 0
    out = capsys.readouterr().out
    assert out.strip() == f"no saved conversations in {data_home}"


def test_list_does_not_load_the_tui(data_home, chats):
    data_home.parent.mkdir(parents=True)
    chats.rename(data_home)
    code = ("import sys; from cpchat.cli import main; code = main(['--list']); "
            "assert 'textual' not in sys.modules, 'textual imported'; sys.exit(code)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "XDG_DATA_HOME": str(data_home.parents[1]),
                               "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])})
    assert done.returncode == 0, done.stderr
    assert "20231114-100000-11" in done.stdout


def test_a_reader_that_goes_away_ends_the_listing_quietly(data_home):
    """`cpchat --list | head -0`: stdout's reader is gone before the first line; exit 0, no traceback."""
    read, write = os.pipe()
    os.close(read)
    env = {**os.environ, "XDG_DATA_HOME": str(data_home.parents[1])}
    done = subprocess.run([sys.executable, "-m", "cpchat", "--list"], stdout=write, stderr=subprocess.PIPE,
                          text=True, timeout=120, env=env)
    os.close(write)
    assert done.returncode == 0 and done.stderr == ""


def test_a_transcript_that_cannot_be_read_is_an_error_not_an_empty_conversation(tmp_path):
    with pytest.raises(FileNotFoundError):
        TranscriptStore.load(tmp_path / "gone.jsonl")
    (tmp_path / "folder.jsonl").mkdir()
    with pytest.raises(IsADirectoryError):
        TranscriptStore.load(tmp_path / "folder.jsonl")
