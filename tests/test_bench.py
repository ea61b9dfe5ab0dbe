"""`cpchat bench` end to end on a tiny configuration: it writes its table, JSON and chart."""

import importlib.util
import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

from cpchat import blas
from cpchat.bench.cli import main as bench_main
from cpchat.bench.compare_mlx_lm import exchange_wait_ms
from cpchat.bench.speculation import best_steps
from cpchat.client.launcher import rank_environment


@pytest.mark.slow
def test_bench_writes_results(tmp_path, model_dir):
    out = tmp_path / "bench"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "cpchat",
            "bench",
            "--model",
            str(model_dir("llama")),
            "--contexts",
            "64,128",
            "--ranks",
            "1,2",
            "--repeats",
            "1",
            "--decode",
            "4",
            "--transport",
            "1,9",  # 9 MiB: a block of three frames between real ranks
            "--data-planes",
            "grpc,shm,mlx",  # N=2 once per data plane; N=1 has none
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    data = json.loads((out / "results.json").read_text())
    systems = {(r["system"], r["context"]) for r in data["rows"]}
    assert systems == {(s, c) for s in ("mlx-lm", "cpchat N=1", "cpchat N=2 grpc", "cpchat N=2 shm",
                                        "cpchat N=2 mlx") for c in (64, 128)}
    config = json.loads((model_dir("llama") / "config.json").read_text())
    layers, kv_heads, head_dim = (config[k] for k in ("num_hidden_layers", "num_key_value_heads", "head_dim"))
    kv_per_token = layers * 2 * kv_heads * head_dim * 4  # K and V, float32: 2 x 2 x 2 x 16 x 4 = 512 bytes
    for row in data["rows"]:
        assert row["prefill_tokens_per_s"][0] > 0 and row["decode_tokens_per_s"][0] > 0
        # peak resident memory of a process holding an MLX runtime and a model: tens of MiB at least
        assert 20 << 20 < row["peak_bytes_per_rank"] < 8 << 30
        context = row["context"]
        # --decode 4: the prefill gives the first token, 3 decode steps add one token's K/V each (the last
        # token's K/V are never computed): context + 3 tokens held
        if row["system"] == "cpchat N=1":
            assert row["kv_bytes_per_rank"] == (context + 3) * kv_per_token
            assert row["hidden_share"] is None and row["ring_bytes"] == 0  # nothing crosses
        if row["system"].startswith("cpchat N=2"):
            # head-tail sharding gives each rank context / 2 of the prompt; decoded positions go round
            # robin (position % 2), so context, context + 2 to rank 0: the fullest holds context / 2 + 2
            assert row["kv_bytes_per_rank"] == (context // 2 + 2) * kv_per_token
            # pass-KV on 2 ranks: in each layer each rank sends its block once, the K and V (float32)
            # of its context / 2 tokens and their positions (int32): per layer context x (2 x 2 x 16 x 4 + 4)
            assert row["ring_bytes"] == layers * context * (2 * kv_heads * head_dim * 4 + 4)
            # 1 - waited / transfer, clamped at 0: below 1, since every wait for a block is counted
            assert 0.0 <= row["hidden_share"] < 1.0
            assert row["decode_step"] == "gather"  # ranks of one machine: rank 0 decodes on a copy of the K/V
            # and in a gather step nothing crosses per layer: no rank waits for another, no exchange costs
            assert row["exchange_wait_ms"] == 0.0 and row["exchange_overhead_ms"] == 0.0
        if row["system"].startswith("cpchat"):  # the model's FLOPs at the measured rate, over sgemm's
            assert 0.0 < row["sgemm_share"] < 2.0
    assert [t["block_mib"] for t in data["transport"]] == [1, 9]
    for t in data["transport"]:
        assert t["grpc_ring_gb_s"] > 0 and t["grpc_bytes_only_gb_s"] > 0 and t["tcp_socket_gb_s"] > 0
        assert t["shm_ring_gb_s"] > 0 and t["shm_latency_us"] > 0 and t["grpc_latency_us"] > 0
        assert t["mlx_ring_gb_s"] > 0 and t["mlx_latency_us"] > 0
    table = (out / "results.md").read_text()
    # every row names the BLAS its processes really used, as a separate process detects it
    detect = "from cpchat.blas import in_use; print(in_use().label)"
    used = subprocess.run([sys.executable, "-c", detect], env=rank_environment(), capture_output=True,
                          text=True, timeout=120).stdout.strip()
    assert used and {row["blas"] for row in data["rows"]} == {used}
    # mlx-lm runs on every core, as a user's would; local ranks share them out
    threads = {row["system"]: row["threads"] for row in data["rows"]}
    assert threads["mlx-lm"] == blas.usable_cores() and threads["cpchat N=1"] == blas.usable_cores()
    assert threads["cpchat N=2 shm"] == blas.shared_threads(2)
    assert f"| cpchat N=2 shm | {used} | {blas.shared_threads(2)} | 128 |" in table


@pytest.mark.slow
def test_bench_compares_algorithms(tmp_path):
    """--algorithms: every algorithm's TTFT per (model, N, context) cell, auto's pick and gap, decode
    over both exchanges, and each link's latency; on a GQA (4:1) and an MHA (4:4) model."""
    out = tmp_path / "algorithms"
    result = subprocess.run(
        [sys.executable, "-m", "cpchat", "bench", "--hidden", "64", "--layers", "2", "--heads", "4",
         "--kv-heads", "1,4", "--contexts", "64", "--ranks", "1,2", "--repeats", "1", "--decode", "4",
         "--algorithms", "all", "--decode-exchange", "exchange,ring", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache")},  # the random models go here
    )
    assert result.returncode == 0, result.stderr
    data = json.loads((out / "results.json").read_text())
    models = {"bench-llama-h64-l2-a4-kv1": "4:1", "bench-llama-h64-l2-a4-kv4": "4:4"}
    # prefill cells: N >= 2 only (on one rank every algorithm is the same computation)
    assert {(c["variant"]["model"], c["ranks"], c["context"]) for c in data["prefill"]} == {
        (m, 2, 64) for m in models
    }
    algorithms = ("pass_kv", "pass_q", "all_gather", "ulysses", "auto")
    for cell in data["prefill"]:
        assert set(cell["ttft_ms"]) == set(algorithms)
        assert all(len(cell["ttft_ms"][a]) == 1 for a in algorithms)  # --repeats 1
        best = {a: min(cell["ttft_ms"][a]) for a in algorithms}  # from the JSON's own measured times
        assert cell["best_ttft_ms"] == best and all(best[a] > 0 for a in algorithms)
        assert cell["auto_pick"] in algorithms[:4] and cell["fastest"] in algorithms[:4]
        assert best[cell["fastest"]] == min(best[a] for a in algorithms[:4])  # of the forced ones
        gap = 100 * (best[cell["auto_pick"]] / best[cell["fastest"]] - 1)
        assert cell["auto_gap_pct"] == pytest.approx(gap, rel=1e-9, abs=1e-9)
        # auto picks the least of the cost model's estimates (rounded to 0.1 ms in the JSON, which keeps
        # the least one least)
        assert set(cell["estimates_ms"]) == set(algorithms[:4])
        assert cell["estimates_ms"][cell["auto_pick"]] == min(cell["estimates_ms"].values())
        assert cell["auto_reason"].startswith("least estimated: ")
        assert cell["auto_ran"] == [cell["auto_pick"]] and cell["auto_consistent"]
    assert {(r["variant"]["model"], r["ranks"], r["exchange"]) for r in data["decode"]} == {
        (m, n, e) for m in models for n in (1, 2) for e in ("exchange", "ring")
    }
    for row in data["decode"]:
        assert row["context"] == 64 and row["best_ms_per_token"] > 0
        assert len(row["wait_ms"]) == (row["ranks"] > 1)  # a step's wait for the other rank, per layer
        # every rank takes the other's partial output in every layer, and a take is never instant: the wait
        # is positive. Of it, the exchange's own is less: in each layer the attention skew between the
        # ranks is taken off the wait of the rank whose attention was quicker (exchange_wait_ms; held to
        # its numbers in test_exchange_wait_is_the_wait_less_the_attention_skew)
        assert all(0.0 <= o < w for o, w in zip(row["overhead_ms"], row["wait_ms"], strict=True))
    assert [(lat["variant"]["model"], lat["ranks"]) for lat in data["latency"]] == [(m, 2) for m in models]
    for lat in data["latency"]:
        links = lat["link_us"]
        assert len(links) == 2 and all(links[i][j] > 0 for i in range(2) for j in range(2) if i != j)
        assert lat["exchange_us"] > 0
    table = (out / "results.md").read_text()
    assert "Command: `cpchat bench --hidden 64 " in table and "; BLAS: " in table and " cores" in table
    for model, heads in models.items():
        assert f"| {model} | {heads} | 2 | 64 | " in table  # a prefill row
        assert f"| {model} | {heads} | 1 | 64 | " in table  # a decode row for one rank
    for heading in ("pass-KV", "pass-Q", "all-gather", "Ulysses", "auto gap", "exchange ms/token",
                    "ring ms/token", "ring wait ms/layer (overhead)", "from \\ to"):
        assert heading in table


@pytest.mark.slow
def test_bench_prefix_cache(tmp_path):
    """--prefix-cache on the demo model at a tiny context: a second session on new ranks loads the first
    one's prefix from disk, on one rank and on two, and the report says so."""
    out = tmp_path / "prefix"
    result = subprocess.run(
        [sys.executable, "-m", "cpchat", "bench", "--prefix-cache", "--contexts", "600", "--ranks", "1,2",
         "--decode", "4", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr
    data = json.loads((out / "prefix-cache.json").read_text())
    assert [(c["ranks"], c["context"]) for c in data["cells"]] == [(1, 600), (2, 600)]
    for cell in data["cells"]:
        (trial,) = cell["trials"]
        second = trial["second"]
        assert second["cache"] == "disk" and second["load_ms"] > 0
        assert 600 <= second["reused_tokens"] < second["prompt_tokens"]  # the document, not the question
        assert second["reused_tokens"] + second["new_tokens"] == second["prompt_tokens"]
        assert trial["save_on"]["cache"] == trial["save_off"]["cache"] == "none"  # fresh ranks, empty disk
        assert trial["save_on"]["ttft_ms"] > 0 and trial["save_off"]["wall_ms"] > 0
        # What each rank's file must hold (cpchat/rank/prefix_shard.py): the conversation's token ids
        # (uint32) and, for each position the rank holds, its position (int32) once and in each of the 6
        # layers, and float32 K and V of 6 layers x 6 KV heads x 32 (assets/demo-model/config.json); and
        # a JSON header. The conversation: the prompt and 3 of the 4 decoded tokens (the last one's K/V
        # are never computed). Of the prompt, 2 ranks hold head-tail chunks of ceil(prompt / 4): rank 1
        # the middle two, rank 0 the rest; decoded positions go round robin (position % 2).
        kv_per_token = 6 * 2 * 6 * 32 * 4
        prompt = trial["save_on"]["prompt_tokens"]
        total = prompt + 3
        if cell["ranks"] == 1:
            held = [total]
        else:
            chunk = -(-prompt // 4)
            middle = min(3 * chunk, prompt) - chunk
            held = [prompt - middle + 2, middle + 1]  # positions prompt, prompt + 2 to rank 0; + 1 to rank 1
        assert len(trial["disk_bytes"]) == cell["ranks"]
        assert cell["disk_bytes_per_rank"] == max(trial["disk_bytes"])
        for b, tokens in zip(trial["disk_bytes"], held, strict=True):
            header = b - 4 * total - tokens * (kv_per_token + 4 + 6 * 4)
            assert 0 < header < kv_per_token  # a few KiB: smaller than one token's K/V, so `tokens` is exact
        # second TTFT over first (save on), each the best of the trials: here of the one trial
        assert cell["ttft_share"] == pytest.approx(second["ttft_ms"] / trial["save_on"]["ttft_ms"], rel=1e-9)
        assert trial["save_on"]["tail_ms"] >= 0 and trial["write_wait_ms"] >= 0
    table = (out / "prefix-cache.md").read_text()
    assert "Command: `cpchat bench --prefix-cache --contexts 600 " in table
    assert "| demo-model | 1 | 600 | " in table and "| demo-model | 2 | 600 | " in table
    assert " | disk | " in table and "second / first" in table
    chart = out / "prefix-cache.png"
    if importlib.util.find_spec("matplotlib"):  # the bench extra
        assert chart.stat().st_size > 0
    else:
        assert not chart.exists() and "matplotlib is not installed" in result.stderr


def test_exchange_wait_is_the_wait_less_the_attention_skew():
    """exchange_wait_ms on hand-made stats of 2 ranks and 2 layers: step 0 a layer's own attention, step 1
    the wait for the other rank's partial."""

    def rank(attention: list[float], waits: list[float]) -> SimpleNamespace:
        steps = [SimpleNamespace(layer=i, step=0, compute_ms=a, wait_ms=0.0) for i, a in enumerate(attention)]
        steps += [SimpleNamespace(layer=i, step=1, compute_ms=0.0, wait_ms=w) for i, w in enumerate(waits)]
        return SimpleNamespace(ring_steps=steps)

    served = SimpleNamespace(attention_layers=2)
    # rank 0 waits 3.0 ms in all, 1.0 of it for rank 1's slower attention in layer 0: 1.5 a layer, 1.0 its
    # own; rank 1 waits 1.75, less than rank 0's 2.0 slower attention in layer 1: 0.875 a layer, none its own
    stats = [rank([1.0, 3.0], [2.5, 0.5]), rank([2.0, 1.0], [0.25, 1.5])]
    assert exchange_wait_ms(stats, served) == ((1.5 + 0.875) / 2, (1.0 + 0.0) / 2)
    # a lead step: only rank 0 waits (the other only attends), so the figures are rank 0's alone
    assert exchange_wait_ms([stats[0], rank([2.0, 1.0], [])], served) == (1.5, 1.0)
    assert exchange_wait_ms([rank([], []), rank([], [])], served) == (0.0, 0.0)  # a gather step: none


@pytest.mark.parametrize("flag, value", [("--transport", "''"), ("--contexts", "1k"), ("--ranks", "0,2")])
def test_a_mistyped_list_is_refused_before_anything_runs(flag, value, capsys, tmp_path):
    assert bench_main([flag, value, "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"cpchat bench: {flag} {value}: expected a comma list of whole numbers"]
    assert not list(tmp_path.iterdir())  # nothing measured, nothing written


def test_the_best_draft_lengths_are_a_shortest_path_over_the_answer():
    """Hand-computed: the answer repeats the prompt, so after its first token lookup proposes the rest."""
    prompt = [1, 2, 3, 4, 5, 6]
    assert best_steps(prompt, [1, 2, 3, 4, 5, 6], cost=0.0) == 1.0  # one check of all five
    assert best_steps(prompt, [1, 2, 3, 4, 5, 6], cost=0.5) == 3.0  # 1 + 0.5 x 4: 5 tokens in one step
    assert best_steps(prompt, [1, 2, 3, 4, 5, 6], cost=2.0) == 5.0  # a proposal dearer than a step: none
    assert best_steps(prompt, [9, 8, 7], cost=0.1) == 2.0  # nothing to copy: plain steps
    # [2, 3] copied after 1 and 8 sampled (1 + 0.5 x 2), then a plain step (8 occurred nowhere before)
    assert best_steps(prompt, [1, 2, 3, 8, 4], cost=0.5) == 3.0


@pytest.mark.slow
def test_bench_speculation(tmp_path):
    """--speculate off,lookup on the demo model at a tiny context, one rank: both modes give the same
    answers; the lookup rows say what proposals cost and the most any draft lengths could give."""
    out = tmp_path / "speculation"
    result = subprocess.run(
        [sys.executable, "-m", "cpchat", "bench", "--speculate", "off,lookup", "--contexts", "512",
         "--ranks", "1", "--repeats", "1", "--out", str(out)],
        capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stderr
    rows = json.loads((out / "speculation.json").read_text())["rows"]
    assert [(r["question"], r["mode"]) for r in rows] == [
        ("quotes", "off"), ("quotes", "lookup"), ("copies nothing", "off"), ("copies nothing", "lookup")]
    assert all(r["same_answer"] for r in rows)
    quote = rows[1]
    assert quote["proposed"] and quote["accepted"] and quote["steps"] < quote["decided"]
    assert quote["check_cost"] >= 0 and quote["best"] > 1  # the quote's proposals pay, for the best lengths
    table = (out / "speculation.md").read_text()
    assert "| best lengths | check cost |" in table and f"| {quote['best']:.2f}× |" in table
