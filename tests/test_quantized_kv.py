"""--kv-bits: each rank keeps its K/V share quantized as mlx-lm's QuantizedKVCache does, the ring carries
the quantized form, and the answers are mlx-lm's own `generate_step(kv_bits=B, kv_group_size=G,
quantized_kv_start=S)`: greedy tokens identical, and logprobs within 1e-3 of mlx-lm's for a float32 model;
for a low-precision checkpoint, within 1.5x of mlx-lm's own noise with the same kv_bits (the checkpoint in
its dtype against the same weights in float32; in bfloat16, mlx-lm's quantized attention rounds its scores
to bfloat16, which moves a logprob by up to 0.45 on the demo model where float32 scores do not)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import DEMO_MODEL
from helpers import done_event, next_turn, question_ids, random_prompt, raw_session
from references import MlxReference, quantized_reads, reference_tokenizer

from cpchat.core.quantized_kv import KVFormat, quantized_from
from cpchat.errors import BadInput
from cpchat.rank.prefix_file import read_header
from cpchat.smallmodels import write_model

MAX_TOKENS = 8
ALGORITHMS = ("pass_kv", "pass_q", "all_gather", "ulysses")


@pytest.fixture(scope="module")
def references():
    """One mlx-lm worker per (checkpoint, K/V format), kept for the module."""
    workers: dict[tuple, MlxReference] = {}

    def get(path, kv: KVFormat) -> MlxReference:
        if (path, kv) not in workers:
            workers[path, kv] = MlxReference(path, kv)
        return workers[path, kv]

    yield get
    for worker in workers.values():
        worker.close()


def assert_as_mlx_lm(got, reference, low_precision: bool, noise_floor: float = 0.0):
    """Tokens identical; logprobs within 1e-3 of mlx-lm's, or for a `low_precision` checkpoint within 1.5x
    of mlx-lm's own noise with the same kv_bits, at least `noise_floor`: that noise measured over a longer
    prompt of the same document (over a prompt of a token or a few, the largest difference is a maximum
    over too few positions to tell)."""
    expected, noise = reference
    bound = 1.5 * max(noise, noise_floor) if low_precision else 1e-3
    assert [t for t, _ in got] == [t for t, _ in expected]
    worst = max((abs(a - b) for (_, a), (_, b) in zip(got, expected, strict=True)), default=0.0)
    assert worst <= bound, f"logprobs off by {worst:.5f}, allowed {bound:.5f}; mlx-lm's own noise {noise:.5f}"


# ---- the semantics: where mlx-lm's generate_step starts to read quantized K/V


def test_quantized_from_is_where_mlx_lm_starts(tmp_path):
    path = write_model(tmp_path / "llama", "llama", hidden_size=128, num_heads=2)
    cases = [(1, 0), (2, 0), (7, 5), (3000, 0), (3000, 2048), (3000, 2049), (3000, 2999), (3000, 3001),
             (4500, 4097), (20, 40)]
    for length, start in cases:
        calls = quantized_reads(path, [length], start)  # each forward's first position, and quantized?
        first = quantized_from(0, length, start)
        assert [q for _, q in calls] == [p >= first for p, _ in calls], (length, start)
        # A second turn: cpchat's ring lacks the answer's last token, which mlx-lm read alone; it comes
        # first in cpchat's next prompt.
        if any(q for _, q in calls):
            continue
        both = quantized_reads(path, [length, 2500], start)
        ring = both[len(calls)][0] - 1  # where the second turn starts, less that token
        second = [c for c in both if c[0] >= ring]
        first = quantized_from(ring, 1 + 2500, start, lone_first=True)
        assert [q for _, q in second] == [p >= first for p, _ in second], (length, start)


# ---- through real ranks


def checkpoint_path(checkpoint, form: str):
    return DEMO_MODEL if form == "float32" else checkpoint(form)


@pytest.mark.slow
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("form", ["float32", "bfloat16", "q4g64"])
def test_kv_bits_through_ranks(clusters, references, checkpoint, form, bits):
    """N = 1..4: prompts of 1 and 2N+1 tokens (the prompt's last token and the answer read quantized K/V)
    with each algorithm in turn, and a question and a follow-up about a demo document per algorithm,
    whose second prefill reads quantized K/V across the ring. (Demo documents, as the model was trained
    on: random token ids leave it torn between tokens, where 4-bit K/V in bfloat16 flip mlx-lm's own
    choice between float32 and bfloat16.)"""
    path = checkpoint_path(checkpoint, form)
    kv = KVFormat(bits, 32, 0)  # the demo model's heads are 32 wide
    reference = references(path, kv)
    ids, questions = question_ids(path, seed=3, n_questions=2)
    follow_up = reference_tokenizer(path).encode(
        f"<|im_end|>\n<|im_start|>user\n{questions[0]}<|im_end|>\n<|im_start|>assistant\n",
        add_special_tokens=False)
    # mlx-lm's two turns, asked in order (its worker keeps the conversation's cache between them)
    first = reference(ids, MAX_TOKENS)
    second = reference(ids + [t for t, _ in first[0]] + follow_up, MAX_TOKENS)
    for ranks in (1, 2, 3, 4):
        cluster = clusters.get(ranks, path, kv=kv)
        for i, length in enumerate((1, 2 * ranks + 1)):
            prompt = ids[-length:]  # the end of the question: the answer follows
            reference.submit(prompt, MAX_TOKENS)
            cluster.reset(0)
            session = raw_session(cluster, path, ALGORITHMS[(ranks + i) % 4], MAX_TOKENS)
            got, _ = next_turn(session, prompt)
            assert got and len(got) == len(reference(prompt, MAX_TOKENS)[0])
            assert_as_mlx_lm(got, reference(prompt, MAX_TOKENS), form != "float32", first[1])
        for algorithm in ALGORITHMS if ranks > 1 else ALGORITHMS[:1]:
            cluster.reset(0)
            session = raw_session(cluster, path, algorithm, MAX_TOKENS)
            for new, expected in ((ids, first), (follow_up, second)):
                got, _ = next_turn(session, new)
                assert_as_mlx_lm(got, expected, form != "float32")


@pytest.mark.slow
@pytest.mark.parametrize("ranks, algorithm", [(2, "pass_kv"), (3, "all_gather"), (4, "ulysses")])
def test_a_prompt_past_the_first_chunk(clusters, references, ranks, algorithm):
    """2,300 tokens: mlx-lm reads the first 2,048 in full precision and the rest quantized; so does
    cpchat, in two prefill passes (the second carries packed K/V around the ring)."""
    kv = KVFormat(4, 32, 0)
    reference = references(DEMO_MODEL, kv)
    ids = random_prompt(DEMO_MODEL, 2300, seed=7)
    reference.submit(ids, MAX_TOKENS)
    cluster = clusters.get(ranks, DEMO_MODEL, kv=kv)
    got, events = next_turn(raw_session(cluster, DEMO_MODEL, algorithm, MAX_TOKENS), ids)
    assert_as_mlx_lm(got, reference(ids, MAX_TOKENS), low_precision=False)
    _, full = next_turn(raw_session(clusters.get(ranks, DEMO_MODEL), DEMO_MODEL, algorithm, MAX_TOKENS), ids)
    # The shard holds packed K/V: 4 bits a value and a float32 scale and bias per 32, against 32 bits.
    packed, plain = ([(r.kv_tokens, r.kv_bytes) for r in done_event(e).ranks] for e in (events, full))
    assert [n for n, _ in packed] == [n for n, _ in plain]
    assert [b for _, b in packed] == [b * (4 / 8 + 2 * 4 / 32) / 4 for _, b in plain]


@pytest.mark.slow
def test_default_group_size_and_a_hybrid_model(clusters, references, tmp_path):
    """Groups of 64 (mlx-lm's default) on 64-wide heads; and Nemotron-H, whose Mamba layers keep their
    state in full precision while its attention layer's K/V are quantized, as in mlx-lm."""
    for arch in ("llama", "nemotron_h"):
        path = write_model(tmp_path / arch, arch, hidden_size=128, num_heads=2, num_kv_heads=1)
        kv = KVFormat(8, 64, 16)
        reference = references(path, kv)
        cluster = clusters.get(2, path, kv=kv)
        session = raw_session(cluster, path, "all_gather", MAX_TOKENS)
        history: list[int] = []
        for turn, length in enumerate((12, 30)):
            new = random_prompt(path, length, seed=turn)
            got, _ = next_turn(session, new)
            history += new
            assert_as_mlx_lm(got, reference(history, MAX_TOKENS), low_precision=False)
            history += [t for t, _ in got]


@pytest.mark.slow
@pytest.mark.parametrize("arch, options, says", [
    ("mistral", {"sliding_window": 8}, "sliding-window layers keep a rotating cache"),
    ("gpt_oss", {}, "sliding-window layers"),
    ("deepseek_v3", {}, "multi-head latent attention"),
    ("llama", {}, "--kv-group-size 64 does not divide llama's head size 16"),
])
def test_what_mlx_lm_cannot_quantize_is_refused_by_name(clusters, tmp_path, arch, options, says):
    path = write_model(tmp_path / arch, arch, **options)
    cluster = clusters.get(2, DEMO_MODEL)
    with pytest.raises(BadInput, match=says) as refusal:
        cluster.load(str(path), kv_format=KVFormat(4, 64, 0))
    assert arch in str(refusal.value) and "\n" not in str(refusal.value)
    clusters.loaded.pop((2, "auto"))  # the ranks keep the old model; reload it for the next test


def test_sinks_are_refused_by_name():
    """gpt-oss is the one family with sinks, and its sliding layers are refused first: the sink check on
    its own, on a model shape as a rank would find it."""
    from cpchat.rank.fit import LayerAttention
    from cpchat.rank.model_load import KVFormatRefused, ModelShape, check_kv_format

    layer = LayerAttention(None, 4, 2, 64, 64, 4, sinks=True)
    shape = ModelShape("gpt_oss", 1, 4, 2, 64, 512, 4, 0, [layer], None, kv_format=KVFormat(4, 64, 0))
    with pytest.raises(KVFormatRefused, match="gpt_oss's attention sinks"):
        check_kv_format(shape)


@pytest.mark.slow
def test_headless_kv_bits(tmp_path):
    """The flags reach the ranks; bad values are one line and exit 2; the done event's kv_bytes are the
    packed bytes; the prefix cache keeps the packed form and a later session loads it exactly."""
    doc = tmp_path / "doc.txt"
    doc.write_text("The lighthouse keeper on Varn Island is called Ada Morrow. " * 150)  # saved: 1K+ tokens
    cache = tmp_path / "prefixes"

    def run(*flags: str) -> tuple[int, list[dict], str]:
        argv = [sys.executable, "-m", "cpchat", "--headless", "--json", "--ranks", "2", "--doc", str(doc),
                "--prompt", "Who keeps the lighthouse?", "--max-tokens", "8", "--cache-dir", str(cache),
                *flags]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=300)
        return done.returncode, [json.loads(line) for line in done.stdout.splitlines()], done.stderr

    rc, _, err = run("--kv-bits", "4")  # the demo model's heads are 32 wide
    assert rc == 2 and err.strip().count("\n") == 0 and "try --kv-group-size 32" in err
    rc, _, err = run("--kv-bits", "3")
    assert rc == 2 and "--kv-bits" in err
    flags = ("--kv-bits", "4", "--kv-group-size", "32", "--quantized-kv-start", "0")
    rc, first, _ = run(*flags)
    assert rc == 0 and next(e for e in first if e["event"] == "ready")["kv_bits"] == 4
    done = next(e for e in first if e["event"] == "done")
    assert all(r["kv_bytes"] == r["kv_tokens"] * 6 * 2 * 6 * 32 * 0.75 for r in done["ranks"])
    files = sorted(cache.glob("*.kvp"))
    assert files and all(read_header(f)["quantized"] for f in files)
    rc, again, _ = run(*flags)
    prefill = next(e for e in again if e["event"] == "prefill")
    assert rc == 0 and prefill["cache"] == "disk" and prefill["reused_tokens"] > 0
    tokens = [[(e["id"], e["logprob"]) for e in run if e["event"] == "token"] for run in (first, again)]
    assert [t for t, _ in tokens[1]] == [t for t, _ in tokens[0]]
    assert [lp for _, lp in tokens[1]] == pytest.approx([lp for _, lp in tokens[0]], abs=1e-4)


def test_settings_take_kv_bits(tmp_path):
    from cpchat.cli import app_parser
    from cpchat.client.settings import resolve_settings

    config = tmp_path / "config.toml"
    config.write_text("kv_bits = 8\nkv_group_size = 32\n")
    settings = resolve_settings(app_parser().parse_args(["--quantized-kv-start", "100"]), config)
    assert settings.kv_format == KVFormat(8, 32, 100)
    assert settings.sources["kv_bits"] == str(config)
    config.write_text("kv_bits = 5\n")
    with pytest.raises(BadInput, match="kv_bits"):
        resolve_settings(app_parser().parse_args([]), config)
