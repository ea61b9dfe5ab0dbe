"""The memory check before every prefill: ranks report what they may still allocate (under their own
--memory-limit) and what a forward costs them; the front end refuses a prompt some rank cannot hold,
naming the rank, the need and the free memory, before any rank allocates."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import replace

import pytest
from helpers import Asked, next_turn, random_prompt, raw_session
from pilot import RANKS, SIZE, attach_with_question, click, ready, until
from rankprocs import loaded_ring, start_ranks

from cpchat.client.cluster import Cluster
from cpchat.client.held import HeldConversations
from cpchat.client.memory import MemoryShortfall, StageSplit, shortfall
from cpchat.client.plan import make_plan, plan_lines
from cpchat.client.settings import Settings
from cpchat.core.heuristics import Workload
from cpchat.core.memory import ForwardMemory, kv_bytes_per_token, prefill_needs, tokens_per_rank
from cpchat.core.quantized_kv import KVFormat
from cpchat.rank.memory import host_available, memory_groups
from cpchat.serve.scheduler import Scheduler
from cpchat.tui.app import CpchatApp
from cpchat.tui.screens import MemoryBudget
from cpchat.tui.widgets import ChatInput

LIMIT = 400 << 20
WORKLOAD = Workload(new_tokens=10_000, cached_tokens=0, ranks=2, q_heads=8, kv_heads=2, head_dim=64,
                    value_dim=64, bytes_per_element=4, layers=4)
FORWARD = [ForwardMemory(1e6, 20_000)] * 2


MALLOC_PROBE = """
import ctypes, sys
from cpchat.rank.memory import reuse_freed_blocks

class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd",
                                                     "usmblks", "fsmblks", "uordblks", "fordblks",
                                                     "keepcost")]

libc = ctypes.CDLL(None)
libc.mallinfo2.restype = MallInfo2
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
if sys.argv[1] == "reuse":
    reuse_freed_blocks()
before = libc.mallinfo2().hblks
block = libc.malloc(16 << 20)
print(libc.mallinfo2().hblks - before)
libc.free(block)
"""


def test_a_rank_keeps_freed_blocks_of_a_forward_for_reuse():
    """By default glibc maps a 16 MiB block of its own (fresh pages, cleared by the kernel, each time
    one is asked for); a rank keeps such blocks in its heap, for the next forward."""
    mapped = {mode: int(subprocess.check_output([sys.executable, "-c", MALLOC_PROBE, mode], text=True))
              for mode in ("default", "reuse")}
    assert mapped == {"default": 1, "reuse": 0}


def test_the_need_grows_with_the_prompt_and_falls_with_more_ranks():
    def total(w: Workload, algorithm: str = "pass_kv") -> float:
        return prefill_needs(w, algorithm, [FORWARD[0]] * w.ranks, [0] * w.ranks)[0].total

    assert total(replace(WORKLOAD, new_tokens=20_000)) > total(WORKLOAD)
    assert total(replace(WORKLOAD, ranks=4)) < total(WORKLOAD)
    # all-gather holds every rank's block of a layer at once, pass-KV three
    assert total(replace(WORKLOAD, ranks=8), "all_gather") > total(replace(WORKLOAD, ranks=8), "pass_kv")
    assert tokens_per_rank(10_001, 2) == [5_002, 5_002]  # padded to 2N chunks
    assert tokens_per_rank(10_001, 2, (3, 1)) == [7_502, 2_502]
    need = prefill_needs(WORKLOAD, "pass_kv", FORWARD, [0, 0], answer_tokens=1000)[0]
    assert need.forward_bytes == 1e6 + 20_000 * 5_000
    per_token = 4 * 2 * (64 + 64) * 4  # K and V of 2 heads, 4 layers, float32
    assert need.kv_bytes == 5_000 * per_token and need.answer_bytes == 500 * per_token


def test_a_shortfall_says_what_would_fit():
    free = int(prefill_needs(WORKLOAD, "pass_kv", FORWARD, [0, 0])[0].total * 0.6)
    refused = shortfall(WORKLOAD, "pass_kv", FORWARD, [free, 10 * free], 16, ["rank 0 (a:1)", "rank 1 (b:1)"])
    assert refused is not None and refused.need.rank == 0
    assert str(refused).startswith("rank 0 (a:1) needs ")
    ranks = int(re.search(r"(\d+) ranks like it", str(refused))[1])
    longest = int(re.search(r"up to ([\d,]+) new tokens", str(refused))[1].replace(",", ""))

    def fits(w: Workload) -> bool:
        return shortfall(w, "pass_kv", [FORWARD[0]] * w.ranks, [free] * w.ranks, 16, ["r"] * w.ranks) is None

    assert fits(replace(WORKLOAD, ranks=ranks)) and not fits(replace(WORKLOAD, ranks=ranks - 1))
    assert fits(replace(WORKLOAD, new_tokens=longest)) and not fits(replace(WORKLOAD, new_tokens=longest + 1))
    assert shortfall(WORKLOAD, "pass_kv", FORWARD, [10 * free] * 2, 16, ["r", "r"]) is None
    # rank 1 has room to spare: shares in proportion to free memory would hold it on these two ranks
    weights = re.search(r"--shares (\d+),(\d+) would hold it", str(refused))
    roomy = (int(weights[1]), int(weights[2]))
    assert roomy[1] > 2 * roomy[0]
    shared = replace(WORKLOAD, shares=roomy)
    assert shortfall(shared, "pass_kv", FORWARD, [free, 10 * free], 16, ["r", "r"]) is None
    # K/V held in full precision would shrink with --kv-bits: suggested where that frees enough
    held = replace(WORKLOAD, cached_tokens=200_000)
    need = prefill_needs(held, "pass_kv", FORWARD, [0, 0], 16)[0].total
    assert "--kv-bits 4" in str(shortfall(held, "pass_kv", FORWARD, [int(need * 0.9)] * 2, 16, ["r", "r"]))
    assert "--kv-bits" not in str(shortfall(replace(held, kv_format=KVFormat(4)), "pass_kv", FORWARD,
                                           [int(need * 0.1)] * 2, 16, ["r", "r"]))


def test_more_stages_are_suggested_where_the_weights_they_free_would_hold_it():
    """The same two ranks as two pipeline stages each hold half the layers' K/V of all the tokens and
    half the weights: suggested where the weights freed make the room, not otherwise."""
    need = prefill_needs(WORKLOAD, "pass_kv", FORWARD, [0, 0], 16)[0].total
    staged = replace(WORKLOAD, ranks=1, layers=WORKLOAD.layers // 2)
    need_staged = prefill_needs(staged, "pass_kv", FORWARD[:1], [0], 16)[0].total
    free = int(need) - 1
    weights = int(2 * (need_staged - free)) + (1 << 20)  # half of them freed: enough
    labels = ["r", "r"]
    refused = shortfall(WORKLOAD, "pass_kv", FORWARD, [free] * 2, 16, labels, StageSplit(1, 2, weights))
    assert "--stages 2 would hold it" in str(refused)
    refused = shortfall(WORKLOAD, "pass_kv", FORWARD, [free] * 2, 16, labels, StageSplit(1, 2, weights // 4))
    assert refused is not None and "--stages" not in str(refused)


def test_a_draft_model_s_k_v_count_on_the_rank_that_samples():
    """--speculate draft:MODEL: the first rank (it samples) also holds the draft's K/V of the conversation;
    where only those make it short, the refusal says that lookup would hold it."""
    needs = prefill_needs(WORKLOAD, "pass_kv", FORWARD, [0, 0], 16)
    drafted = prefill_needs(WORKLOAD, "pass_kv", FORWARD, [0, 0], 16, draft_bytes=5e6)
    assert drafted[0].total == needs[0].total + 5e6 and drafted[1].total == needs[1].total
    free = [int(needs[0].total) + (1 << 20)] * 2
    assert shortfall(WORKLOAD, "pass_kv", FORWARD, free, 16, ["r", "r"]) is None
    refused = shortfall(WORKLOAD, "pass_kv", FORWARD, free, 16, ["r", "r"], draft_bytes=5e6)
    assert refused is not None and refused.need.rank == 0
    assert "its draft model's K/V take 4.8 MiB: --speculate lookup would hold it" in str(refused)
    refused = shortfall(WORKLOAD, "pass_kv", FORWARD, [free[0] // 2] * 2, 16, ["r", "r"], draft_bytes=5e6)
    assert refused is not None and "--speculate" not in str(refused)


@pytest.mark.parametrize("version", [1, 2])
def test_the_limit_of_this_processes_own_cgroup_and_those_above_it_counts(tmp_path, version):
    """/proc/self/cgroup names the group: its limit, or a parent's, bounds what a rank may hold, not
    only the root group's files (a container's or a systemd slice's limit sits below the root)."""
    proc, root = tmp_path / "cgroup", tmp_path / "sys"
    top, limit, usage = (root, "memory.max", "memory.current") if version == 2 else \
        (root / "memory", "memory.limit_in_bytes", "memory.usage_in_bytes")
    proc.write_text("0::/slice/job\n" if version == 2 else "4:memory:/slice/job\n1:cpu:/\n")
    for group, bound, used in (("", "max", 9_000_000), ("slice", "5000000", 1_000_000),
                               ("slice/job", "max", 0)):
        (top / group).mkdir(parents=True, exist_ok=True)
        (top / group / limit).write_text(bound if version == 2 or bound != "max" else str(1 << 63))
        (top / group / usage).write_text(str(used))
    groups = memory_groups(proc, root)
    assert (top / "slice" / limit, top / "slice" / usage) in groups
    assert host_available(groups) == 4_000_000  # the slice's limit less what it holds
    assert host_available(memory_groups(tmp_path / "absent", root)) > 4_000_000  # the root group's only


@pytest.fixture(scope="module")
def limited(model_dir, tmp_path_factory):
    """Two ranks that may hold 400 MiB each, the llama test model loaded."""
    ranks = start_ranks(RANKS, tmp_path_factory.mktemp("limited"), args=[["--memory-limit", "400M"]] * RANKS)
    with loaded_ring(ranks, model_dir("llama")) as cluster:
        yield cluster


@pytest.mark.slow
def test_ranks_report_free_memory_under_their_limit_and_a_forwards_cost(limited):
    free = limited.free_memory()
    rss = [s.rss_bytes for s in limited.stats_once()]
    for f, held in zip(free, rss, strict=True):  # less what it holds, MLX's reusable cache aside
        assert LIMIT - held * 1.1 <= f <= LIMIT
    assert all(f.per_token_bytes > 0 for f in limited.forward_memory)
    assert limited.model.weight_bytes > 0


def too_long(cluster: Cluster, session) -> int:
    """A prompt length some rank cannot hold: the need model's, from what the ranks report."""
    tokens = 1000
    while session.planner.memory_shortfall(tokens, 0, "pass_kv", 4) is None:
        tokens *= 2
    return tokens


def test_a_prompt_no_rank_can_hold_is_refused_before_any_rank_allocates(limited, model_dir):
    session = raw_session(limited, model_dir("llama"), "pass_kv", max_tokens=4)
    tokens = too_long(limited, session)
    assert tokens > 4096  # a short prompt is never refused
    before = limited.stats_once()
    with pytest.raises(MemoryShortfall) as refused:
        next_turn(session, [7] * tokens)
    message = str(refused.value)
    assert re.match(r"rank [01] \(127\.0\.0\.1:\d+\) needs [\d.]+ (MiB|GiB) for this prompt but has "
                    r"[\d.]+ (MiB|GiB) free: ", message), message
    assert "ranks like it would hold it" in message and "new tokens fits" in message
    after = limited.stats_once()
    for b, a in zip(before, after, strict=True):
        assert a.kv_tokens == 0 and a.state == "ready"
        assert a.peak_rss_bytes < b.peak_rss_bytes + (16 << 20)  # nothing of the long prompt was allocated
    # and what fits is served on the same ranks
    got, _ = next_turn(session, [7] * 300)
    assert len(got) == 4


def test_held_conversations_go_least_recent_first_for_a_prompt_that_needs_their_room(limited, model_dir):
    """A server's ranks hold two conversations; a prompt that fits only without them lets the least
    recently used go, and no more than it needs (the ranks give its memory back to the system)."""
    limited.reset(0)  # every conversation earlier tests left
    session = raw_session(limited, model_dir("llama"), "pass_kv", max_tokens=4)
    session.conversations = HeldConversations(limit=8)
    edge = too_long(limited, session)
    for seed in (1, 2):
        next_turn(session, random_prompt(model_dir("llama"), edge // 8, seed=seed))
        session.raw_history = []
    first, second = sorted(session.conversations.by_name.values(), key=lambda h: h.used)
    low, high = 1000, edge  # the shortest prompt refused beside them
    while high - low > 16:
        middle = (low + high) // 2
        low, high = (low, middle) if session.prompt_shortfall([7] * middle, 4) else (middle, high)
    assert session.make_room([7] * high, 4) is None  # and so passes the check the prefill makes
    assert set(session.conversations.by_name) == {second.name}
    assert [s.sequences for s in limited.stats_once()] == [1, 1]


def test_a_draft_model_is_counted_before_the_prefill_and_in_the_plan(limited, model_dir):
    """The front end loads the draft on the rank that samples (rank 0 here) and counts its weights and
    its K/V of the prompt and answer there: a prompt the ranks hold without a draft but not with one
    is refused before any rank allocates, naming the draft's share; `cpchat plan` shows it on rank 0."""
    path = model_dir("llama")
    session = raw_session(limited, path, "pass_kv", max_tokens=4)
    session.planner.shares = "equal"  # (auto shares would give rank 1 more of a prompt rank 0 cannot hold)
    plain = too_long(limited, session)
    held = limited.load_draft(str(path))
    assert held.weight_bytes > 0 and held.token_bytes > 0
    tokens = next(t for t in range(plain // 2, plain, 256)
                  if session.planner.memory_shortfall(t, 0, "pass_kv", 4, str(path)) is not None)
    session.speculate = f"draft:{path}"
    before = limited.stats_once()
    with pytest.raises(MemoryShortfall, match=r"^rank 0 .*its draft model's K/V take .*--speculate lookup "
                                              "would hold it"):
        next_turn(session, [7] * tokens)
    after = limited.stats_once()
    assert all(a.kv_tokens == b.kv_tokens and a.peak_rss_bytes < b.peak_rss_bytes + (16 << 20)
               for a, b in zip(before, after, strict=True))
    plan = make_plan(session.planner, 1000, 16, str(path))
    held = limited.load_draft(str(path))
    assert plan.ranks[0].draft_bytes == held.weight_bytes + held.need(1016) and plan.ranks[1].draft_bytes == 0
    without = make_plan(session.planner, 1000, 16)
    assert plan.ranks[0].need_bytes - without.ranks[0].need_bytes == held.need(1016)
    assert ", draft model " in plan_lines(plan, "llama")[1]


@pytest.fixture(scope="module")
def uneven(model_dir, tmp_path_factory):
    """Two ranks, one with three times the other's memory, the llama test model loaded."""
    ranks = start_ranks(RANKS, tmp_path_factory.mktemp("uneven"),
                        args=[["--memory-limit", "400M"], ["--memory-limit", "1200M"]])
    with loaded_ring(ranks, model_dir("llama")) as cluster:
        yield cluster


@pytest.mark.slow
def test_auto_shares_give_the_rank_with_room_the_tokens_the_other_cannot_hold(uneven, model_dir):
    """A prompt rank 0 cannot hold its equal share of: refused under equal shares with the shares that
    would hold it named; under auto those shares, rank 1 taking the most (not run: too long here)."""
    path = model_dir("llama")
    equal = raw_session(uneven, path, "pass_kv", max_tokens=4, shares="equal")
    tokens = too_long(uneven, equal)
    refused = equal.planner.memory_shortfall(tokens, 0, "pass_kv", 4)
    assert refused.need.rank == 0 and refused.roomy is not None and refused.roomy[1] > 2 * refused.roomy[0]
    assert max(refused.roomy) <= 16, "small integers a person can type"
    assert f"--shares {refused.roomy[0]},{refused.roomy[1]} would hold it" in str(refused)
    auto = raw_session(uneven, path, "pass_kv", max_tokens=4)
    shares = auto.planner.prefill_shares(tokens, 0, "pass_kv", 4)  # free memory read again: may round
    assert shares is not None and shares[1] > 2 * shares[0] and max(shares) <= 16
    roomy = replace(auto.planner.workload(tokens, 0), shares=shares)
    assert shortfall(roomy, "pass_kv", uneven.forward_memory, uneven.free_memory(), 4, ["r", "r"]) is None


@pytest.mark.slow
def test_headless_refuses_with_one_line_and_exit_2(model_dir, tmp_path):
    prompt = tmp_path / "long.txt"
    prompt.write_text("word " * 40_000)  # 120,001 tokens: inside the context, twice what 300M hold
    env = {**os.environ, "CPCHAT_MEMORY_LIMIT": "300M"}
    result = subprocess.run([sys.executable, "-m", "cpchat", "--headless", "--ranks", "2", "--raw",
                             "--model", str(model_dir("llama")), "--prompt-file", str(prompt)],
                            capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert re.fullmatch(r"cpchat: rank [01] \(127\.0\.0\.1:\d+\) needs .+ for this prompt but has .+ free.*",
                        lines[-1]), result.stderr
    assert "Traceback" not in result.stderr and result.stdout == ""
    assert "prefill should take" not in result.stderr, "no estimate for a prefill that will not run"


@pytest.mark.slow
@pytest.mark.anyio
async def test_the_tui_says_why_a_prompt_is_not_sent(limited, model_dir, tmp_path):
    session = raw_session(limited, model_dir("llama"), "pass_kv", max_tokens=4)
    doc = tmp_path / "long.txt"
    doc.write_text("word " * (too_long(limited, session) // 3))  # a word is 3 tokens
    assert len(doc.read_text()) < 5 * 131_072 // 3, "within the model's context"
    app = CpchatApp(Settings(max_tokens=4, seed=1), cluster=limited, model_path=str(model_dir("llama")),
                    transcripts=tmp_path / "transcripts")
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await attach_with_question(pilot, doc, "What is it about?")
        app.query_one(ChatInput).focus()
        await pilot.press("enter")
        await until(pilot, lambda: isinstance(app.screen, MemoryBudget) and app.screen.query("Label"),
                    what="the memory dialog, composed")
        dialog = app.screen
        text = " ".join(str(label.render()) for label in dialog.query("Label"))
        assert re.search(r"needs [\d.]+ \w+ on rank [01] \(127\.0\.0\.1:\d+\), which has", text), text
        assert not dialog.query("#send"), "no sending anyway past a rank's memory"
        await click(pilot, dialog.query_one("#remove-0"))
        await until(pilot, lambda: app.chat.turns_done == 1 and not app.chat.busy, what="the turn without it")
        assert app.chat.backend.session.messages[0].docs == []


@pytest.mark.slow
def test_cpchat_plan_prints_a_line_per_rank_and_whether_it_fits(model_dir):
    result = subprocess.run([sys.executable, "-m", "cpchat", "plan", "--model", str(model_dir("llama")),
                             "--context", "4K", "--ranks", "2", "--max-tokens", "16", "--shares", "3,1",
                             "--algorithm", "pass_kv", "--speculate", f"draft:{model_dir('llama')}"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].endswith(": 4,096 tokens on 2 ranks (pass_kv)"), lines[0]
    size = r"[\d.]+ \w+"
    drafts = (f"draft model {size}, ", "")  # rank 0 samples: it holds the draft model
    for rank, tokens, draft, line in zip((0, 1), ("3,072", "1,024"), drafts, lines[1:3], strict=True):
        assert re.fullmatch(rf"rank {rank} \(127\.0\.0\.1:\d+\): {tokens} tokens, weights {size}, "
                            rf"K/V {size}, {draft}peak {size}; the prefill needs {size} of {size} free: fits",
                            line), line
    assert re.fullmatch(r"time to first token about \d+ s; decode about [\d.]+ tokens/s", lines[3]), lines[3]
    assert lines[-1] == "fits on every rank"


def test_a_plan_past_a_ranks_memory_says_so(limited, model_dir):
    session = raw_session(limited, model_dir("llama"), "auto", max_tokens=16)
    tokens = too_long(limited, session)
    plan = make_plan(session.planner, tokens, 16)
    assert not all(r.fits for r in plan.ranks)
    assert plan.refusal.startswith("rank ") and " needs " in plan.refusal
    lines = plan_lines(plan, "llama")
    assert lines[-1] == f"does not fit: {plan.refusal}"
    fitting = make_plan(session.planner, 500, 16)  # too_long's length depends on what the ranks hold
    assert all(r.fits for r in fitting.ranks) and not fitting.refusal
    # K/V scale with the context; the weights do not
    assert plan.ranks[0].kv_bytes > 10 * fitting.ranks[0].kv_bytes
    assert plan.ranks[0].weight_bytes == fitting.ranks[0].weight_bytes == limited.model.weight_bytes
    assert plan.ranks[0].need_bytes > 10 * fitting.ranks[0].need_bytes
    # The peak: the rank's own peak so far, or what it holds plus the prefill's need, whichever is more
    assert plan.ranks[0].peak_bytes >= fitting.ranks[0].peak_bytes
    assert plan.ranks[0].peak_bytes > plan.ranks[0].need_bytes


def test_a_gather_plan_counts_the_other_ranks_kv_on_rank_0(model_dir):
    """While the ranks decode in gather steps rank 0 also holds the other ranks' K/V and the answer's:
    the plan's peak for rank 0 says so (a long answer, where those outweigh the rest)."""
    path = model_dir("llama")
    cluster = Cluster.launch(2)  # its own: a pooled rank's highest RSS so far is part of every peak
    try:
        cluster.connect()
        cluster.load(str(path))
        session = raw_session(cluster, path, "pass_kv", max_tokens=16)
        context, answer = 100, 1_000_000
        plans = {}
        for decode in ("lead", "gather"):
            session.planner.decode = decode
            plans[decode] = make_plan(session.planner, context, answer)
    finally:
        cluster.close()
    # rank 1 holds half
    copy = (context // 2 + answer) * kv_bytes_per_token(session.planner.workload(context, 0))
    assert copy > 100 << 20
    assert plans["gather"].ranks[0].peak_bytes - plans["lead"].ranks[0].peak_bytes > 0.8 * copy
    assert abs(plans["gather"].ranks[1].peak_bytes - plans["lead"].ranks[1].peak_bytes) < 0.1 * copy


def test_with_kv_bits_the_new_keys_and_values_are_held_packed():
    """Past the quantized start a rank keeps the prefill's K/V quantized; below it, as they are."""
    full = prefill_needs(WORKLOAD, "pass_kv", FORWARD, [0, 0])[0]
    q4 = replace(WORKLOAD, kv_format=KVFormat(4, 64, 5000))
    packed = prefill_needs(q4, "pass_kv", FORWARD, [0, 0])[0]
    per_token = 4 * 2 * (64 + 64)  # 4 layers, 2 heads, K and V
    assert full.kv_bytes == 5_000 * per_token * 4
    assert packed.kv_bytes == pytest.approx(5_000 * per_token * (0.5 + 8 / 64))
    assert packed.forward_bytes == full.forward_bytes
    early = prefill_needs(replace(q4, kv_format=KVFormat(4, 64, 20_000)), "pass_kv", FORWARD, [0, 0])[0]
    assert early.kv_bytes == full.kv_bytes


def test_a_request_that_fits_only_without_the_answers_under_way_waits_for_them(limited, model_dir):
    """The scheduler counts the tokens an answer under way may still add: a prompt that fits alone but
    not beside it waits (not refused) while it decodes, and runs once it has left the batch."""
    limited.reset(0)
    path = model_dir("llama")
    session = raw_session(limited, path, "pass_kv", max_tokens=4)
    session.conversations = HeldConversations(limit=8)
    low, high = 4, 1 << 24  # the longest answer an 8-token prompt may ask for
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if session.prompt_shortfall([7] * 8, middle) is None else (low, middle)
    answer = low * 95 // 100  # and a little less
    length = 256  # a prompt that fits alone but not beside that answer
    while session.prompt_shortfall([7] * length, 4 + answer) is None:
        length *= 2
    second = random_prompt(path, length, seed=4)
    assert session.prompt_shortfall(second, 4) is None
    scheduler = Scheduler(session, max_batch=4, ranks_answer=lambda: None)
    try:
        first, waiting = Asked([7] * 8, answer), Asked(second, 4)
        scheduler.submit(first)
        first.wait_for_tokens(2)
        scheduler.submit(waiting)
        seen = len(first.tokens_out)
        first.wait_for_tokens(seen + 5)  # the first decodes on, the second waits
        assert not waiting.admitted.is_set() and list(scheduler.waiting) == [waiting]
        scheduler.cancel(first)
        assert first.ended.wait(120) and waiting.ended.wait(120)
        assert waiting.refusal is None and len(waiting.tokens_out) == 4
    finally:
        scheduler.stop()
