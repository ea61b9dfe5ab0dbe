"""Pipeline stages x context ranks (--stages) through real rank processes: each rank reads only its
stage's layers, hands its rows' hidden states to the next stage's rank with the same rows, and the
answer is mlx-lm's own single-process generation (tokens, and logprobs within 1e-3; in a 4-bit
checkpoint within 1.5x of mlx-lm's own noise), for P x C in 2x1, 3x1, 4x1 and 2x2, every prefill
algorithm and decode step, prompts of 1 token and of lengths 2C does not divide."""

import json
import re
import struct

import pytest
from helpers import (
    ALGORITHMS,
    assert_same,
    events,
    next_turn,
    one_line_error,
    prefill_event,
    question_ids,
    random_prompt,
    rank_holds,
    raw_session,
    run,
    run_raw,
)
from rankprocs import start_ranks, stop_all
from references import MlxReference, low_precision_noise, reference_generate

from cpchat.bench.compare_algorithms import BenchUsageError
from cpchat.bench.shares import cpu_quota
from cpchat.client.cluster import Cluster
from cpchat.client.connect import ClusterOptions
from cpchat.client.events import Progress
from cpchat.client.frontend import Frontend
from cpchat.client.plan import make_plan
from cpchat.client.planner import Planner
from cpchat.client.settings import Settings
from cpchat.core.quantized_kv import KVFormat
from cpchat.core.stages import (
    ONE_STAGE,
    Stages,
    WeightParts,
    memory_split,
    parse_stages,
    pipeline_cuts,
    pipeline_seconds,
    speed_split,
)
from cpchat.dirs import new_user
from cpchat.errors import BadInput
from cpchat.smallmodels import write_model

MAX_TOKENS = 6
LAYOUTS = [(2, 1), (3, 1), (4, 1), (2, 2)]  # stages, context ranks a stage
DECODE_STEPS = ("exchange", "ring", "lead", "gather")


@pytest.fixture(scope="module")
def deep_model(tmp_path_factory):
    """deep_model(arch) -> a small float32 model with enough layers for four stages."""
    root = tmp_path_factory.mktemp("deep")
    built = {}

    def get(arch: str, layers: int = 4):
        if arch not in built:
            built[arch] = write_model(root / arch, arch, num_layers=layers)
        return built[arch]

    return get


def layout_param(stages: int, ring: int, fast: bool = False):
    marks = () if fast else (pytest.mark.slow,)
    return pytest.param(stages, ring, id=f"{stages}x{ring}", marks=marks)


@pytest.mark.parametrize("stages, ring", [layout_param(s, c, fast=(s, c) == (2, 2)) for s, c in LAYOUTS])
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_stages_answer_as_mlx_lm(clusters, deep_model, arch, stages, ring):
    path = deep_model(arch)
    cluster = clusters.get(stages * ring, path, stages=Stages(stages))
    assert cluster.ring_size == ring and cluster.model.stages == stages
    for length in (1, 5, 2 * ring * 3 + 1):
        ids = random_prompt(path, length, seed=length)
        expected = reference_generate(path, ids, MAX_TOKENS)
        for algorithm in ALGORITHMS if ring > 1 else ("auto",):
            cluster.reset(0)
            got, _, _ = run_raw(cluster, path, ids, algorithm, MAX_TOKENS)
            assert_same(got, expected)
    if ring > 1:
        for step in DECODE_STEPS:
            cluster.reset(0)
            session = raw_session(cluster, path, "pass_kv", MAX_TOKENS)
            session.planner.decode = step
            got, _ = next_turn(session, ids)
            assert_same(got, expected)


@pytest.mark.parametrize("stages, ring", [layout_param(2, 2, fast=True), layout_param(3, 1)])
def test_a_long_prompt_flows_through_the_stages_in_chunks(clusters, deep_model, stages, ring):
    """1,100 tokens go through the stages in 4 chunks (cpchat.rank.stages.pipeline_cuts), the stages
    after the first waiting for the one before: the answer is still mlx-lm's."""
    path = deep_model("llama")
    cluster = clusters.get(stages * ring, path, stages=Stages(stages))
    ids = random_prompt(path, 1100, seed=11)
    got, events, _ = run_raw(cluster, path, ids, "auto", MAX_TOKENS)
    assert_same(got, reference_generate(path, ids, MAX_TOKENS))
    assert [e for e in events if isinstance(e, Progress)][-1].processed == len(ids)
    waits = prefill_event(events).stage_wait_ms
    assert len(waits) == stages * ring
    # the first stage never waits; a later one does, for some chunk (a rank whose request came late
    # may find its first chunks ready)
    assert all(w == 0 for w in waits[:ring]) and any(w > 0 for w in waits[ring:])


def test_each_rank_holds_only_its_stages_weights(clusters, deep_model):
    """The layer ranges tile the model; a rank of a stage holds less than a rank of the whole model,
    stage 0 the embedding, the last stage the norm and head: for an untied model, the middle
    stages of 4 hold the fewest bytes."""
    path = deep_model("qwen3")  # untied: its head is a weight of its own
    whole = clusters.get(4, path).ranks[0].weight_bytes
    cluster = clusters.get(4, path, stages=Stages(4))
    assert [r.layers for r in cluster.ranks] == [(0, 1), (1, 2), (2, 3), (3, 4)]
    assert [r.stage for r in cluster.ranks] == [0, 1, 2, 3]
    held = [r.weight_bytes for r in cluster.ranks]
    assert max(held) < whole
    assert held[1] == held[2] < min(held[0], held[3])  # a layer alone, then with embedding or head
    layer = held[1]
    assert held[0] + held[3] - 2 * layer < whole - 4 * layer + 1024  # embedding + head + norm, no more
    cluster = clusters.get(2, path, stages=parse_stages("1,3"))
    assert [r.layers for r in cluster.ranks] == [(0, 1), (1, 4)]
    layers, embedding, rest = file_bytes(path)  # from the files' own headers
    expected = [sum(layers[:1]) + embedding, sum(layers[1:]) + rest]
    for r, share in zip(cluster.ranks, expected, strict=True):
        assert abs(r.weight_bytes - share) <= 0.1 * share, (r.weight_bytes, share)


def file_bytes(path) -> tuple[list[int], int, int]:
    """Bytes of each layer's tensors, the embedding's and the rest's, from the safetensors headers."""
    header = {}
    for f in path.glob("*.safetensors"):
        with f.open("rb") as stream:
            header |= json.loads(stream.read(struct.unpack("<Q", stream.read(8))[0]))
    sizes = {name: t["data_offsets"][1] - t["data_offsets"][0] for name, t in header.items()
             if name != "__metadata__"}
    layers: dict[int, int] = {}
    for name, size in sizes.items():
        if match := re.match(r"model\.layers\.(\d+)\.", name):
            layers[int(match[1])] = layers.get(int(match[1]), 0) + size
    embedding = sum(size for name, size in sizes.items() if "embed_tokens" in name)
    rest = sum(sizes.values()) - sum(layers.values()) - embedding
    return [layers[i] for i in sorted(layers)], embedding, rest


def test_a_plan_counts_each_stages_layers_and_weights(clusters, deep_model):
    """Two ranks as two stages hold every token's K/V of half the layers: as much as the two ranks of
    one stage hold of half the tokens in every layer; and half the weights each."""
    path = deep_model("llama")
    one = make_plan(Planner(clusters.get(2, path)), 1000, 16)
    two = make_plan(Planner(clusters.get(2, path, stages=Stages(2))), 1000, 16)
    assert [r.tokens for r in one.ranks] == [500, 500] and [r.tokens for r in two.ranks] == [1000, 1000]
    for a, b in zip(one.ranks, two.ranks, strict=True):
        assert b.kv_bytes == pytest.approx(a.kv_bytes)  # (1000 + 16) x 2 layers = (500 + 8) x 4 layers
        assert b.weight_bytes < a.weight_bytes
    assert not two.refusal and two.ttft_s and two.decode_tokens_per_s


@pytest.mark.slow
@pytest.mark.parametrize("stages, ring", [(2, 1), (2, 2)])
@pytest.mark.parametrize("arch, layers", [("gemma3_text", 6), ("qwen3_next", 4)])
def test_windows_and_linear_layers_split(clusters, deep_model, arch, layers, stages, ring):
    """Sliding-window layers (Gemma 3) and Gated DeltaNet states (Qwen3-Next) stay with their stage."""
    path = deep_model(arch, layers)
    cluster = clusters.get(stages * ring, path, stages=Stages(stages))
    for length in (1, 2 * ring + 1, 37):
        ids = random_prompt(path, length, seed=length)
        cluster.reset(0)
        got, _, _ = run_raw(cluster, path, ids, "auto", MAX_TOKENS)
        assert_same(got, reference_generate(path, ids, MAX_TOKENS))


@pytest.mark.slow
def test_a_4bit_checkpoint_and_a_follow_up_turn(clusters, checkpoint):
    path = checkpoint("q4g64")
    cluster = clusters.get(4, path, stages=Stages(2))
    ids, questions = question_ids(path, seed=5, n_questions=1)
    session = raw_session(cluster, path, "auto", MAX_TOKENS)
    got, _ = next_turn(session, ids)
    expected = reference_generate(path, ids, MAX_TOKENS)
    assert [t for t, _ in got] == [t for t, _ in expected]
    noise = low_precision_noise(path, ids, expected)
    assert max(abs(a - b) for (_, a), (_, b) in zip(got, expected, strict=True)) <= 1.5 * noise
    follow = random_prompt(path, 7, seed=9)
    history = ids + [t for t, _ in got] + follow
    got, _ = next_turn(session, follow)
    assert [t for t, _ in got] == [t for t, _ in reference_generate(path, history, MAX_TOKENS)]


@pytest.mark.slow
def test_kv_bits_across_stages(clusters, tmp_path):
    """4-bit K/V from the first token on: each stage quantizes its own layers' K/V as mlx-lm would."""
    path = write_model(tmp_path / "llama", "llama", num_layers=4, hidden_size=128, num_heads=2)
    kv = KVFormat(4, 32, 0)
    cluster = clusters.get(4, path, kv=kv, stages=Stages(2))
    reference = MlxReference(path, kv)
    try:
        ids = random_prompt(path, 13, seed=2)
        expected, _ = reference(ids, MAX_TOKENS)
        got, _, _ = run_raw(cluster, path, ids, "pass_kv", MAX_TOKENS)
        assert_same(got, expected)
    finally:
        reference.close()


def test_a_split_that_cannot_be_made_is_refused(clusters, deep_model):
    path = deep_model("llama")
    cluster = clusters.get(4, path)
    for stages, says in ((Stages(3), "does not divide 4 ranks"),
                         (Stages(2, (1, 2)), "do not split the model's 4 layers into 2 stages"),
                         (Stages(4, (1, 1, 1, 1)), None)):
        if says is None:
            cluster.load(str(path), stages=stages)
            continue
        with pytest.raises(BadInput, match=says) as refusal:
            cluster.load(str(path), stages=stages)
        assert "\n" not in str(refusal.value)
    cluster = clusters.get(2, path)
    with pytest.raises(BadInput, match="2 stages for a model of 1 layers|at most one stage a layer"):
        cluster.load(str(write_model(path.parent / "one-layer", "llama", num_layers=1)), stages=Stages(2))
    clusters.loaded.clear()  # the ranks keep whatever they loaded last


@pytest.mark.slow
def test_headless_stages_and_what_they_say(tmp_path):
    """`cpchat --headless --stages 2`: the ready event names each rank's stage, layers and weights; the
    answer is the one-stage answer; a second run reads the document's prefix from the stages' files;
    a split that cannot be made is one line and exit 2."""
    document = tmp_path / "notes.txt"
    document.write_text("The ring passes keys and values from rank to rank. " * 150)  # past 1,024 tokens

    def run_turn(cache: str, *flags: str) -> list[dict]:
        result = run(["--headless", "--json", "--ranks", "2", "--doc", str(document), "--prompt",
                      "What does a rank hold?", "--max-tokens", "6", "--cache-dir", str(tmp_path / cache),
                      *flags])
        assert result.returncode == 0, result.stderr
        return events(result.stdout)

    staged, whole = run_turn("staged", "--stages", "2"), run_turn("whole")
    ready = staged[0]
    assert ready["event"] == "ready" and ready["stages"] == 2
    assert [(r["stage"], r["layers"]) for r in ready["ranks"]] == [(0, [0, 3]), (1, [3, 6])]  # the demo's 6
    assert all(0 < r["weight_bytes"] < w["weight_bytes"] for r, w in zip(ready["ranks"], whole[0]["ranks"]))
    tokens = [[e["id"] for e in run if e["event"] == "token"] for run in (staged, whole)]
    assert tokens[0] == tokens[1] and tokens[0]
    again = next(e for e in run_turn("staged", "--stages", "2") if e["event"] == "prefill")
    assert again["cache"] == "disk" and again["reused_tokens"] > 1024
    for stages, says in (("4", "--stages 4 does not divide 2 ranks"),
                         ("2,2", "layer counts 2,2 do not split the model's 6 layers into 2 stages")):
        one_line_error(run(["--headless", "--ranks", "2", "--stages", stages, "--prompt", "hi"]), 2, says)


@pytest.mark.slow
@pytest.mark.alone  # a rank's headroom, measured once, must hold while it loads
def test_a_model_no_rank_holds_is_refused_before_it_is_read_and_auto_splits_it(tmp_path, monkeypatch):
    """Ranks limited to 0.8x a 1024-wide llama's weights: one stage is refused before a weight is read
    (MLX allocated nothing), with the stages that would hold it; --stages auto splits it in two,
    and the answer is mlx-lm's."""
    path = write_model(tmp_path / "wide", "llama", num_layers=6, hidden_size=1024, num_heads=16)
    weights = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    monkeypatch.setenv("CPCHAT_MEMORY_LIMIT", str(4 * weights))
    monkeypatch.setenv("CPCHAT_MEMORY_LIMIT", str(rank_holds(4 * weights, ranks=2) + int(0.8 * weights)))
    cluster = Cluster.launch(2)
    try:
        cluster.connect()
        with pytest.raises(BadInput, match="--stages 2 would hold them"):
            cluster.load(str(path))
        assert all(s.mlx_peak_bytes < 0.05 * weights for s in cluster.stats_once())  # nothing read
    finally:
        cluster.close()
    refused = run(["--headless", "--model", str(path), "--ranks", "2", "--prompt", "hi"])
    one_line_error(refused, 2, "--stages 2 would hold them")
    assert re.search(r"the weights of llama take [\d.]+ MiB but this rank may hold [\d.]+ MiB",
                     refused.stderr)

    front = Frontend(Settings(model=str(path), ranks=2, stages="auto"), ClusterOptions())
    try:
        front.start(lambda phase, done, total: None)
        cluster = front.cluster
        assert cluster.stages == 2 and all(r.weight_bytes < 0.6 * weights for r in cluster.ranks)
        ids = random_prompt(path, 9, seed=4)
        got, _, _ = run_raw(cluster, path, ids, "auto", MAX_TOKENS)
        assert_same(got, reference_generate(path, ids, MAX_TOKENS))
    finally:
        front.close(generating=False)


@pytest.mark.slow
@pytest.mark.alone  # a rank's headroom, measured once, must hold while it loads
def test_auto_gives_a_rank_of_little_memory_fewer_layers(tmp_path):
    """Two attached ranks, one that may hold 0.3x a model's weights, one 1.5x: an even split does not
    fit the first, so auto gives it one layer and the other five; each rank holds its share, and the
    answer is mlx-lm's."""
    path = write_model(tmp_path / "wide", "llama", num_layers=6, hidden_size=1024, num_heads=16)
    weights = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    ranks = start_ranks(1, tmp_path, args=[["--memory-limit", str(4 * weights)]])
    try:
        probe = Cluster([ranks[0].address])
        probe.connect()
        held = 4 * weights - probe.free_memory()[0]  # what an idle rank holds
        probe.close()
    finally:
        stop_all(ranks)
    limits = [held + int(0.3 * weights), held + int(1.5 * weights)]
    ranks = start_ranks(2, tmp_path, args=[["--memory-limit", str(limit)] for limit in limits])
    front = Frontend(Settings(model=str(path), stages="auto"),
                     ClusterOptions(attach=",".join(r.address for r in ranks)))
    try:
        front.start(lambda phase, done, total: None)
        cluster = front.cluster
        assert [r.layers for r in cluster.ranks] == [(0, 1), (1, 6)]
        layers, embedding, rest = file_bytes(path)
        for r, share in zip(cluster.ranks, (layers[0] + embedding, sum(layers[1:]) + rest), strict=True):
            assert abs(r.weight_bytes - share) <= 0.1 * share
        ids = random_prompt(path, 9, seed=6)
        got, _, _ = run_raw(cluster, path, ids, "auto", MAX_TOKENS)
        assert_same(got, reference_generate(path, ids, MAX_TOKENS))
    finally:
        front.close(generating=False)
        stop_all(ranks)


def test_layers_follow_the_stages_speeds():
    assert speed_split([3, 3], [2.0, 1.0]) == [4, 2]
    assert speed_split([10, 10, 10], [1.0, 1.0, 1.0]) == [10, 10, 10]
    assert speed_split([3, 3], [1.0, 0.01]) == [5, 1]  # at least one a stage
    assert speed_split([4, 3], [1.0, 1.0]) == [4, 3]  # a tie: the first stage takes the odd one
    assert speed_split([2, 2, 2], [1.0, 3.0, 2.0]) == [1, 3, 2]


@pytest.mark.slow
@pytest.mark.alone  # the ranks' measured speeds decide the split
def test_a_slower_stage_gets_fewer_layers(tmp_path, monkeypatch):
    """Two attached ranks as two stages, the second held to half a core (a cgroup): loaded evenly
    first, the stages' measured speeds give the faster one more of the six layers, and the answer is
    mlx-lm's."""
    # wide enough that a token's products, not a forward's fixed costs, set the measured speeds
    path = write_model(tmp_path / "llama6", "llama", num_layers=6, seed=3, hidden_size=512, num_heads=8)
    monkeypatch.setenv("XDG_CACHE_HOME", new_user(tmp_path)["XDG_CACHE_HOME"])  # the measures made here
    ranks = start_ranks(2, tmp_path, args=[["--threads", "1"]] * 2)  # a core each, at most
    front = Frontend(Settings(model=str(path), stages="2"),
                     ClusterOptions(attach=",".join(r.address for r in ranks)))
    try:
        with cpu_quota(ranks[1].process.pid, 0.5):
            front.start(lambda phase, done, total: None)
            cluster = front.cluster
            (_, cut), (second, end) = (r.layers for r in cluster.ranks)
            assert cut == second >= 4 and end == 6  # how many more: the speeds measured then
            note = f"--stages 2: layers {cut},{6 - cut}, by the stages' measured speeds"
            assert front.take_notes() == [note]
            ids = random_prompt(path, 9, seed=6)
            got, _, _ = run_raw(cluster, path, ids, "auto", MAX_TOKENS)
            assert_same(got, reference_generate(path, ids, MAX_TOKENS))
    except BenchUsageError as e:
        pytest.skip(str(e))  # no CPU cgroup to create (not root, or not Linux)
    finally:
        front.close(generating=False)
        stop_all(ranks)


def test_a_prompt_is_cut_into_chunks_for_the_stages():
    assert pipeline_cuts(0, 5000, 1) == []
    assert pipeline_cuts(0, 1100, 2) == [275, 550, 825]  # 4 chunks of at least 256 tokens
    assert pipeline_cuts(100, 100 + 8 * 1024, 2) == [100 + 1024 * i for i in range(1, 8)]  # 4 a stage
    assert pipeline_cuts(0, 300, 3) == []  # one chunk
    assert pipeline_seconds([4.0], 1) == 4.0
    assert pipeline_seconds([1.0, 1.0], 4) == pytest.approx(1.25)  # (4 + 2 - 1) chunks of 0.25 s
    assert pipeline_seconds([1.0, 3.0], 3) == pytest.approx(4 / 3 + 2)  # the slow stage sets the pace


def test_a_split_follows_each_stages_memory_where_an_even_one_does_not_fit():
    parts = WeightParts([10] * 6, embedding=4, rest=4, tied=False)  # 30 + 4 and 30 + 4 in halves
    assert memory_split(parts, [100, 100]) == [3, 3]  # even: 34 each, within 3/4 of 100
    assert memory_split(parts, [30, 100]) == [1, 5]  # the first stage holds 14 of 22.5; the rest 54 of 75
    assert memory_split(parts, [30, 60]) is None  # 54 of 45: no split holds it
    assert memory_split(parts, [100] * 7) is None  # more stages than layers
    tied = WeightParts([10] * 6, embedding=4, rest=4, tied=True)
    assert tied.stage_bytes(3, 6, 1, 2) == 38  # the last stage holds the embedding as its head


def test_stages_are_parsed():
    assert parse_stages("1") == ONE_STAGE
    assert parse_stages("3") == Stages(3)
    assert parse_stages("12,18") == Stages(2, (12, 18))
    assert parse_stages("auto").auto
    for bad in ("0", "two", "3,0", ""):
        with pytest.raises(ValueError, match="--stages"):
            parse_stages(bad)
