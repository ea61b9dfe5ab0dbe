"""The prefix cache through real ranks: a session saves each rank's shard of the conversation on
disk, a later session (the ranks' memory emptied, or new rank processes) loads the longest saved
prefix and prefills only the rest, and answers as mlx-lm does over the whole prompt (tokens, and
logprobs within 1e-3), for 1 to 4 ranks, every algorithm, a hybrid and a sliding-window model, a
ring of another size, low-precision checkpoints, and turns after the reload. Files that are corrupt,
of another model or raced for are never loaded wrongly."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
from helpers import VARIANTS, assert_same, done_event, next_turn, prefill_event, random_prompt, raw_session
from references import low_precision_noise, reference_generate

from cpchat.client.events import CacheLoaded, Token
from cpchat.client.held import common_prefix
from cpchat.client.session import Session, load_tokenizer
from cpchat.core.algorithms import PREFILL_ALGORITHMS
from cpchat.core.stages import Stages
from cpchat.dirs import prefix_dir
from cpchat.rank import prefix_file
from cpchat.rank.prefix_cache import CacheMiss, PrefixStore
from cpchat.smallmodels import write_model

MAX_TOKENS = 6
CPCHAT = [sys.executable, "-m", "cpchat"]


def mlx_lm_generate(path: Path, ids: list[int], max_tokens: int) -> list[tuple[int, float]]:
    """mlx-lm's answer up to a stop token of cpchat's tokenizer (a session stops there, unshown)."""
    stop = load_tokenizer(str(path)).eos_token_ids
    answer = reference_generate(path, ids, max_tokens)
    return next((answer[:i] for i, (t, _) in enumerate(answer) if t in stop), answer)


def cached_session(cluster, path: Path, algorithm: str = "auto"):
    session = raw_session(cluster, path, algorithm, MAX_TOKENS)
    session.prefix_cache, session.save_min_tokens = True, 0
    return session


def ask(cluster, path: Path, ids: list[int], algorithm: str = "auto", documents_end: int = 0):
    """A new session (the ranks' memory emptied) on `ids`: (tokens with logprobs, events, session)."""
    cluster.reset(0)
    session = cached_session(cluster, path, algorithm)
    events = list(session.generate(ids, documents_end=documents_end))
    return [(e.id, e.logprob) for e in events if isinstance(e, Token)], events, session


def document_and_questions(path: Path, seed: int, length: int = 70) -> tuple[list[int], list[int], list[int]]:
    doc = random_prompt(path, length, seed)
    first, second = random_prompt(path, 5, seed + 1), random_prompt(path, 6, seed + 2)
    if second[0] == first[0]:
        second = second[1:]
    return doc, first, second


def shard_files(cluster) -> list[Path]:
    """The files of this ring's size, once its ranks finished writing (FindPrefixes waits for that)."""
    cluster.find_prefixes([0])
    return sorted(prefix_dir().glob(f"*-of-{cluster.size}.kvp"))


@pytest.fixture
def empty_cache(clusters):
    clusters.saved()  # a shared cluster's last save of an earlier test lands first
    shutil.rmtree(prefix_dir(), ignore_errors=True)
    yield prefix_dir()


@pytest.mark.slow
@pytest.mark.parametrize("ranks", [1, 2, 3, 4])
def test_a_new_session_loads_the_document_and_answers_as_mlx_lm(clusters, model_dir, ranks, empty_cache):
    """Every algorithm prefills the rest after the load; a turn after the reload goes on from memory."""
    path = model_dir("llama")
    cluster = clusters.get(ranks, path)
    for i, algorithm in enumerate(PREFILL_ALGORITHMS):
        length = 60 + 2 * ranks + 1  # not a multiple of 2N
        doc, first, second = document_and_questions(path, seed=100 * ranks + 10 * i, length=length)
        got, events, _ = ask(cluster, path, doc + first, algorithm)
        assert prefill_event(events).cache == "none"
        assert_same(got, mlx_lm_generate(path, doc + first, MAX_TOKENS))

        got, events, session = ask(cluster, path, doc + second, algorithm)
        prefill = prefill_event(events)
        assert (prefill.cache, prefill.reused_tokens, prefill.cached_tokens) == ("disk", len(doc), len(doc))
        assert prefill.new_tokens == len(second) and prefill.load_ms > 0
        assert [e.tokens for e in events if isinstance(e, CacheLoaded)] == [len(doc)]
        history = doc + second
        assert_same(got, mlx_lm_generate(path, history, MAX_TOKENS))

        history += [t for t, _ in got]
        more = random_prompt(path, 4, seed=7 + i)
        got, events = next_turn(session, more)
        assert prefill_event(events).cache == "memory"
        assert_same(got, mlx_lm_generate(path, history + more, MAX_TOKENS))
    assert len(shard_files(cluster)) >= ranks


def test_the_whole_conversation_is_reused_as_resume_does(clusters, model_dir, empty_cache):
    """A saved turn's end (prompt and answer) serves the next session's longer prompt in full; the
    save of the longer conversation replaces the shorter one's file."""
    path = model_dir("qwen3")
    cluster = clusters.get(3, path)
    doc, first, second = document_and_questions(path, seed=3)
    got, _, _ = ask(cluster, path, doc + first)
    before = shard_files(cluster)
    history = doc + first + [t for t, _ in got] + second
    got, events, _ = ask(cluster, path, history)
    assert prefill_event(events).reused_tokens == len(history) - len(second) - 1  # the last answer token
    # was never run through the model
    assert_same(got, mlx_lm_generate(path, history, MAX_TOKENS))
    after = shard_files(cluster)
    assert len(after) == 3 and not set(before) & set(after)  # the longer save superseded the shorter


def test_a_draft_model_takes_its_state_of_a_conversation_back_from_disk(clusters, model_dir, empty_cache):
    """--speculate draft:MODEL: the sampling rank saves what the draft read beside the ring's shards. A
    conversation taken up again after another one (which the draft followed) loads the ring's prefix
    and the draft's from disk and answers as mlx-lm does; its save supersedes the draft's first file
    (a draft that read the conversation again would have left it)."""
    path = model_dir("llama")
    cluster = clusters.get(2, path)
    doc, first, second = document_and_questions(path, seed=21)

    def drafted(ids: list[int]):
        cluster.reset(0)
        session = cached_session(cluster, path)
        session.speculate = f"draft:{path}"
        return next_turn(session, ids)

    def draft_files() -> list[Path]:
        cluster.find_prefixes([0])  # once the ranks' saves are on disk
        return [p for p in prefix_dir().glob("*-0-of-1.kvp") if prefix_file.read_header(p)["model"].endswith(
            "(draft)")]

    got, _ = drafted(doc + first)
    saved = draft_files()
    assert len(saved) == 1
    drafted(random_prompt(path, 50, seed=23))
    history = doc + first + [t for t, _ in got] + second
    got, events = drafted(history)
    assert prefill_event(events).cache == "disk" and done_event(events).speculation.accepted > 0
    assert_same(got, mlx_lm_generate(path, history, MAX_TOKENS))
    after = draft_files()
    assert len(after) == 2 and saved[0] not in after


def test_a_second_question_saves_nothing_new(clusters, model_dir, empty_cache):
    """The ranks save a conversation once it holds save_min_tokens they have not saved: the first
    session saves the document; a second question about it loads it and adds too little to save; a
    conversation that goes on past that saves again, replacing its own file."""
    path = model_dir("qwen2")
    cluster = clusters.get(2, path)
    doc, first, second = document_and_questions(path, seed=70)

    def session():
        cluster.reset(0)
        s = cached_session(cluster, path)
        s.save_min_tokens = 40
        return s

    next_turn(session(), doc + first)
    saved = shard_files(cluster)
    assert len(saved) == 2
    _, events = next_turn(session(), doc + second)
    assert prefill_event(events).cache == "disk" and shard_files(cluster) == saved
    third = session()
    next_turn(third, doc + second)
    prompt = third.raw_history + random_prompt(path, 45, seed=71)  # 45 past the saved document
    got = [(e.id, e.logprob) for e in third.generate(prompt) if isinstance(e, Token)]
    assert_same(got, mlx_lm_generate(path, prompt, MAX_TOKENS))
    files = shard_files(cluster)
    assert len(files) == 4 and set(saved) < set(files)


@pytest.mark.slow
def test_a_hybrid_model_split_into_stages_keeps_and_reloads_its_states(clusters, tmp_path, empty_cache):
    """Qwen3-Next's layers (linear, attention, linear, attention) as 3 + 1 over two stages, the second
    without linear layers: both prefill in two passes, cut where the documents end (their hidden states
    meet), and a new question reloads the state kept there."""
    path = write_model(tmp_path / "qwen3_next", "qwen3_next", num_layers=4)
    cluster = clusters.get(2, path, stages=Stages(2, (3, 1)))
    doc, first, second = document_and_questions(path, seed=47)
    got, _, session = ask(cluster, path, doc + first, documents_end=len(doc))
    assert_same(got, mlx_lm_generate(path, doc + first, MAX_TOKENS))
    assert len(doc) in session.held.state_positions
    got, events, _ = ask(cluster, path, doc + second)
    assert prefill_event(events).reused_tokens == len(doc)
    assert_same(got, mlx_lm_generate(path, doc + second, MAX_TOKENS))


@pytest.mark.slow
@pytest.mark.parametrize("ranks", [2, 3])
def test_a_hybrid_model_reloads_its_linear_states(clusters, model_dir, ranks, empty_cache):
    """Linear layers' states are saved where the ranks kept them: where the documents end (the prompt
    prefilled in two passes), the prompt's end and the turn's end. A new question about the document,
    a longer one, and the conversation continued each load the state they need, and are exact, then
    and on a turn after."""
    path = model_dir("qwen3_5")
    cluster = clusters.get(ranks, path)
    doc, first, second = document_and_questions(path, seed=40 + ranks)
    got, events, session = ask(cluster, path, doc + first, documents_end=len(doc))
    assert_same(got, mlx_lm_generate(path, doc + first, MAX_TOKENS))
    assert len(doc) in session.held.state_positions
    history = doc + first + [t for t, _ in got]
    for prompt, reused in ((doc + second, len(doc)), (doc + first + second, len(doc + first)),
                           (history + second, len(history) - 1)):
        got, events, session = ask(cluster, path, prompt)
        assert prefill_event(events).reused_tokens == reused
        assert_same(got, mlx_lm_generate(path, prompt, MAX_TOKENS))
        more = random_prompt(path, 3, seed=reused)
        after, _ = next_turn(session, more)  # on from the loaded state
        assert_same(after, mlx_lm_generate(path, prompt + [t for t, _ in got] + more, MAX_TOKENS))


def test_a_turn_knows_where_its_documents_end(model_dir, tmp_path):
    """What a prompt with the same documents and other words shares: the documents, in the template."""
    path = model_dir("qwen3_5")
    doc = tmp_path / "notes.txt"
    doc.write_text("Orion has a belt of three stars. " * 20)
    session = Session(None, load_tokenizer(str(path)))
    one, other = session.prepare("Who is Orion?", [doc]), session.prepare("How many stars?", [doc])
    shared = common_prefix(one.tokens, other.tokens)
    assert 0 < one.documents_end <= shared and shared - one.documents_end <= 3
    assert session.prepare("Who is Orion?").documents_end == 0


@pytest.fixture(scope="module")
def sliding_model(tmp_path_factory):
    arch, options = VARIANTS["mistral-sliding"]
    return write_model(tmp_path_factory.mktemp("sliding") / "m", arch, **options)


@pytest.mark.slow
def test_a_sliding_window_model_reloads_keys_it_had_forgotten(clusters, sliding_model, empty_cache):
    """The ranks forget keys outside the windows after the prompt, but save them first: a new question
    on the same document reloads it (windows of 8, a document of 70 tokens) and is exact, then and on
    the next turn."""
    path = sliding_model
    cluster = clusters.get(3, path)
    doc, first, second = document_and_questions(path, seed=11)
    ask(cluster, path, doc + first)
    got, events, session = ask(cluster, path, doc + second)
    assert prefill_event(events).reused_tokens == len(doc)
    history = doc + second
    assert_same(got, mlx_lm_generate(path, history, MAX_TOKENS))
    history += [t for t, _ in got]
    more = random_prompt(path, 9, seed=12)
    got, _ = next_turn(session, more)
    assert_same(got, mlx_lm_generate(path, history + more, MAX_TOKENS))


@pytest.mark.slow
@pytest.mark.parametrize("saved_by, loaded_by", [(2, 3), (4, 1)])
def test_a_ring_of_another_size_reshards_from_the_saved_shards(clusters, model_dir, saved_by, loaded_by,
                                                              empty_cache):
    path = model_dir("mistral")
    doc, first, second = document_and_questions(path, seed=20 + saved_by)
    ask(clusters.get(saved_by, path), path, doc + first)
    got, events, session = ask(clusters.get(loaded_by, path), path, doc + second)
    assert prefill_event(events).reused_tokens == len(doc)
    assert [e.resharded for e in events if isinstance(e, CacheLoaded)] == [True]
    assert_same(got, mlx_lm_generate(path, doc + second, MAX_TOKENS))
    assert sum(r.kv_tokens for r in done_event(events).ranks) == len(session.held.tokens)  # each token once


@pytest.mark.parametrize("saved_by, loaded_by", [
    ((2, 2), (2, 2)),
    *(pytest.param(a, b, marks=pytest.mark.slow) for a, b in (((2, 2), (1, 2)), ((2, 2), (2, 1)),
                                                                 ((1, 2), (2, 2)), ((1, 2), (2, 1))))])
def test_a_prefix_saved_by_stages_loads_under_any_split(clusters, model_dir, saved_by, loaded_by,
                                                        empty_cache):
    """(stages, context ranks): a stage saves its layers' part of its shard; a rank of any split loads
    its layers from the parts that hold them (re-sharding across ring sizes as without stages)."""
    path = model_dir("llama")
    doc, first, second = document_and_questions(path, seed=31 + 3 * saved_by[0] + loaded_by[0])
    stages, ring = saved_by
    saver = clusters.get(stages * ring, path, stages=Stages(stages))
    ask(saver, path, doc + first)
    saver.find_prefixes([0])  # once its ranks finished writing
    names = [p.name for p in empty_cache.glob("*.kvp")]
    assert len(names) == stages * ring and all(("-layers-" in n) == (stages > 1) for n in names)
    stages, ring = loaded_by
    cluster = clusters.get(stages * ring, path, stages=Stages(stages))
    got, events, session = ask(cluster, path, doc + second)
    prefill = prefill_event(events)
    assert (prefill.cache, prefill.reused_tokens) == ("disk", len(doc))
    assert [e.resharded for e in events if isinstance(e, CacheLoaded)] == [ring != saved_by[1]]
    assert_same(got, mlx_lm_generate(path, doc + second, MAX_TOKENS))
    history = doc + second + [t for t, _ in got]
    more = random_prompt(path, 4, seed=5)
    got, events = next_turn(session, more)
    assert prefill_event(events).cache == "memory"
    assert_same(got, mlx_lm_generate(path, history + more, MAX_TOKENS))


@pytest.mark.slow
@pytest.mark.parametrize("form", ["bfloat16", "q4g64"])
def test_low_precision_checkpoints_reload_within_their_noise(clusters, checkpoint, form, empty_cache):
    """Greedy tokens identical to mlx-lm's over the whole prompt, logprobs within 1.5x of its own noise."""
    path = checkpoint(form)
    cluster = clusters.get(2, path)
    doc, first, second = document_and_questions(path, seed=31, length=90)
    ask(cluster, path, doc + first)
    loaded, events, _ = ask(cluster, path, doc + second)
    assert prefill_event(events).cache == "disk"
    expected = mlx_lm_generate(path, doc + second, MAX_TOKENS)
    noise = low_precision_noise(path, doc + second, expected)
    assert [t for t, _ in loaded] == [t for t, _ in expected]
    assert max(abs(a - b) for (_, a), (_, b) in zip(loaded, expected, strict=True)) <= 1.5 * noise


@pytest.mark.parametrize("damage", ["flip a byte", "truncate", "other version", "whole but wrong"])
def test_a_damaged_file_is_removed_and_the_prompt_prefilled(clusters, model_dir, damage, empty_cache):
    path = model_dir("llama")
    cluster = clusters.get(2, path)
    doc, first, second = document_and_questions(path, seed=50)
    ask(cluster, path, doc + first)
    victim = next(p for p in shard_files(cluster) if p.name.endswith("-1-of-2.kvp"))
    data = bytearray(victim.read_bytes())
    if damage == "whole but wrong":  # its digest holds, but an array is missing
        header, arrays = prefix_file.read(victim)
        del arrays["layer0.keys"]
        prefix_file.write(victim, header, arrays)
        data = bytearray(victim.read_bytes())
    elif damage == "flip a byte":
        data[-5] ^= 0x40
    elif damage == "truncate":
        data = data[: len(data) * 2 // 3]
    else:
        data[8] += 1  # the format version
    victim.write_bytes(bytes(data))
    got, events, _ = ask(cluster, path, doc + second)
    assert prefill_event(events).cache == "none"
    assert_same(got, mlx_lm_generate(path, doc + second, MAX_TOKENS))
    assert not victim.exists()


def test_a_changed_model_file_invalidates_its_prefixes(clusters, model_dir, tmp_path, empty_cache):
    path = Path(shutil.copytree(model_dir("llama"), tmp_path / "model"))
    cluster = clusters.get(1, path)
    doc, first, second = document_and_questions(path, seed=60)
    ask(cluster, path, doc + first)
    _, events, _ = ask(cluster, path, doc + second)
    assert prefill_event(events).cache == "disk"
    weights = path / "model.safetensors"
    weights.write_bytes(weights.read_bytes())  # rewritten: a new modification time
    cluster.load(str(path))
    got, events, _ = ask(cluster, path, doc + second)
    assert prefill_event(events).cache == "none"
    assert_same(got, mlx_lm_generate(path, doc + second, MAX_TOKENS))


def test_files_are_private_and_named_by_the_rank(tmp_path):
    store = PrefixStore(tmp_path / "prefix", max_bytes=1 << 20)
    header = {"prefix_id": "a" * 32, "model_key": "m", "model": "m", "num_ranks": 1, "shard": 0,
              "tokens": 3, "floor": 0, "state_positions": [], "dtypes": {},
              "quantized": False, "segments": [[0, 3]]}
    path = store.save(header, {"tokens": np.arange(3, dtype=np.uint32)})
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(store.root.stat().st_mode) == 0o700
    for bad in ("../../etc/passwd", "A" * 32, "a" * 31):
        with pytest.raises(CacheMiss, match="not a prefix id"):
            store.load(bad, 0, 1, "m")
    with pytest.raises(CacheMiss, match="another model"):
        store.load("a" * 32, 0, 1, "another")
    assert not path.exists()


def test_the_least_recently_used_files_go_first(tmp_path):
    store = PrefixStore(tmp_path, max_bytes=1 << 30)
    paths = []
    for i in range(5):
        header = {"prefix_id": f"{i:032x}", "model_key": "m", "model": "m", "num_ranks": 2, "shard": 0,
                  "tokens": 900, "floor": 0, "state_positions": [], "dtypes": {},
              "quantized": False, "segments": []}
        paths.append(store.save(header, {"tokens": np.full(900, i, np.uint32)}))
        os.utime(paths[-1], ns=(i * 10**9, i * 10**9))
    store.load(f"{0:032x}", 0, 2, "m")  # used: now the most recent
    other = store.save(header | {"prefix_id": "f" * 32, "shard": 1}, {"tokens": np.zeros(900, np.uint32)})
    store.max_bytes = 3 * paths[0].stat().st_size  # the bound is per shard index: `other` does not count
    dead, writing = tmp_path / ".writing-dead.kvp", tmp_path / ".writing-now.kvp"  # a writer that died
    dead.write_bytes(b"x")
    writing.write_bytes(b"x")
    os.utime(dead, (0, 0))
    store.evict(0)
    assert [p.exists() for p in paths] == [True, False, False, True, True] and other.exists()
    assert not dead.exists() and writing.exists()


def test_two_writers_of_one_prefix_leave_one_whole_file(tmp_path):
    store = PrefixStore(tmp_path, max_bytes=1 << 30)
    header = {"prefix_id": "b" * 32, "model_key": "m", "model": "m", "num_ranks": 1, "shard": 0,
              "tokens": 1 << 20, "floor": 0, "state_positions": [], "dtypes": {},
              "quantized": False, "segments": []}
    arrays = {"tokens": np.arange(1 << 20, dtype=np.uint32)}
    writers = [threading.Thread(target=store.save, args=(header, arrays)) for _ in range(4)]
    for w in writers:
        w.start()
    for w in writers:
        w.join()
    assert [p.name for p in tmp_path.iterdir()] == [f"{'b' * 32}-0-of-1.kvp"]
    _, read = prefix_file.read(tmp_path / f"{'b' * 32}-0-of-1.kvp")
    assert np.array_equal(read["tokens"], arrays["tokens"])


def headless(args: list[str], cache: Path) -> list[dict]:
    result = subprocess.run([*CPCHAT, "--headless", "--json", "--max-tokens", "8", "--cache-dir", str(cache),
                             *args], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    return [json.loads(line) for line in result.stdout.splitlines()]


@pytest.mark.slow
def test_separate_headless_runs_reuse_and_race_for_the_document(tmp_path):
    """Two runs at once on one document (both save it: one whole file per shard), then a third run,
    with new ranks, loads it and answers as a run without the cache does."""
    doc = tmp_path / "doc.txt"
    doc.write_text((Path(__file__).parents[1] / "assets" / "demo-model" / "README.md").read_text()[:6000])
    cache = tmp_path / "cache"
    ask_about = ["--ranks", "2", "--doc", str(doc), "--prompt"]
    command = [*CPCHAT, "--headless", "--json", "--max-tokens", "8", "--cache-dir", str(cache)]
    racing = [subprocess.Popen([*command, *ask_about, "What is it?"], stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL) for _ in range(2)]
    assert all(p.wait(timeout=300) == 0 for p in racing)
    files = sorted(cache.iterdir())
    assert [f.name[-11:] for f in files] == ["-0-of-2.kvp", "-1-of-2.kvp"]
    for f in files:
        prefix_file.read(f)  # whole: the checksum holds

    second = headless([*ask_about, "Who trained it?"], cache)
    prefill = next(e for e in second if e["event"] == "prefill")
    assert prefill["cache"] == "disk" and prefill["reused_tokens"] > 1000
    without = headless(["--no-cache", *ask_about, "Who trained it?"], tmp_path / "unused")
    assert next(e for e in without if e["event"] == "prefill")["cache"] == "none"
    tokens = [[e["id"] for e in run if e["event"] == "token"] for run in (second, without)]
    assert tokens[0] == tokens[1]
    assert not (tmp_path / "unused").exists()

    def cache_command(action: str) -> subprocess.CompletedProcess:
        return subprocess.run([*CPCHAT, "cache", action, "--cache-dir", str(cache)], capture_output=True,
                              text=True)

    listed = cache_command("list")
    assert listed.returncode == 0 and "0 of 2" in listed.stdout and "demo-model" in listed.stdout
    cleared = cache_command("clear")
    assert cleared.returncode == 0 and not list(cache.glob("*.kvp"))


def test_cache_settings_come_from_flags_environment_and_config(tmp_path, monkeypatch):
    from cpchat.cli import app_parser
    from cpchat.client.settings import rank_flags, resolve_settings
    from cpchat.errors import BadInput

    config = tmp_path / "config.toml"
    config.write_text('cache_max_gb = 2.5\ncache_dir = "~/kv"\n')
    settings = resolve_settings(app_parser().parse_args([]), config)
    assert rank_flags(settings) == ["--cache-max-gb", "2.5", "--cache-dir", str(Path("~/kv").expanduser())]
    monkeypatch.setenv("CPCHAT_CACHE", "off")
    assert rank_flags(resolve_settings(app_parser().parse_args([]), config)) == ["--no-cache"]
    monkeypatch.setenv("CPCHAT_CACHE", "maybe")
    with pytest.raises(BadInput, match="CPCHAT_CACHE: 'maybe' is not true or false"):
        resolve_settings(app_parser().parse_args([]), config)
    monkeypatch.delenv("CPCHAT_CACHE")
    settings = resolve_settings(app_parser().parse_args(["--no-cache", "--cache-max-gb", "1"]), config)
    assert not settings.cache and settings.sources["cache"] == "flag --cache"


@pytest.mark.slow
def test_a_terminated_rank_finishes_its_files(model_dir, tmp_path):
    """SIGTERM stops a rank cleanly: it finishes the prefix files it is writing, then exits 0."""
    from cpchat.client.cluster import Cluster

    path = model_dir("llama")
    cluster = Cluster.launch(1, flags=["--cache-dir", str(tmp_path)])
    try:
        cluster.connect()
        cluster.load(str(path))
        next_turn(cached_session(cluster, path), random_prompt(path, 80, seed=90))
        process = cluster.ranks[0].local.process
        process.terminate()
        assert process.wait(timeout=60) == 0
    finally:
        cluster.close()
    (saved,) = tmp_path.glob("*.kvp")
    header, arrays = prefix_file.read(saved)
    assert header["tokens"] == len(arrays["tokens"]) >= 80
