"""A model's measured prefill cost, kept on disk by the ranks (cpchat.rank.measures): a rank that loads a
model of the same structure on the same machine reads it instead of measuring for seconds; an entry
that is damaged or old is measured again."""

import json
import os
import time

from mlx_lm.utils import load_model

from cpchat.blas import BlasInfo, cpu_allowance, shared_threads
from cpchat.client.cluster import Cluster
from cpchat.core.estimate import PrefillCost
from cpchat.core.memory import ForwardMemory
from cpchat.dirs import measure_dir, new_user
from cpchat.rank.measures import MAX_AGE_S, MeasureStore, oversubscription
from cpchat.rank.model_load import structure
from cpchat.smallmodels import write_model

COST = PrefillCost(0.125, 0.0625, 2.0**-30, 0.25, 2.0**-29)
MEMORY = ForwardMemory(4096.0, 512.0)


def test_a_store_gives_back_what_it_kept_while_it_is_fresh_and_whole(tmp_path):
    store = MeasureStore(tmp_path / "measures")
    calls = []

    def measure():
        calls.append(1)
        return COST, MEMORY

    assert store.get("k") is None
    assert store.measured("k", measure) == store.measured("k", measure) == (COST, MEMORY)
    assert len(calls) == 1 and store.get("k") == (COST, MEMORY)
    entry = tmp_path / "measures" / "k.json"
    old = time.time() - MAX_AGE_S - 60
    os.utime(entry, (old, old))
    assert store.get("k") is None
    for damage in ("{", json.dumps({"prefill": {"fixed_s": 1}}), ""):
        entry.write_text(damage)
        assert store.get("k") is None
    blocked = MeasureStore(entry)  # a file where the folder should be: nothing kept, nothing raised
    assert blocked.measured("k", measure) == MeasureStore(None).measured("k", measure) == (COST, MEMORY)
    assert len(calls) == 3 and blocked.get("k") is None and MeasureStore(None).get("k") is None


def test_the_key_follows_structure_layers_and_weights_not_weight_values(tmp_path):
    """Two seeds of one config share a structure, another width or depth does not; another layer
    range or weight bytes gives another key; the count of ranks sharing the machine does not (it
    scales the entry)."""

    def shape_of(name: str, **options) -> str:
        model, config = load_model(write_model(tmp_path / name, "llama", **options), lazy=True)
        return structure(config, model)

    a, b = shape_of("a", seed=1), shape_of("b", seed=2)
    assert a == b
    assert len({a, shape_of("wide", seed=1, hidden_size=128), shape_of("deep", seed=1, num_layers=3)}) == 3
    store = MeasureStore(None)
    key = store.key(a, 0, 2, 1000)
    assert key == store.key(b, 0, 2, 1000) == MeasureStore(None, ranks_here=2).key(a, 0, 2, 1000)
    assert len({key, store.key(a, 1, 2, 1000), store.key(a, 0, 2, 2000)}) == 3


def test_ranks_that_share_the_cores_read_the_entry_scaled_by_their_sharing(tmp_path, monkeypatch):
    """Four one-thread ranks on two cores each run half as fast as one measured alone; two, or one of
    two threads, as fast; an entry measured once serves them all."""
    assert [oversubscription(*case) for case in [(4, 1, 2.0), (2, 1, 2.0), (1, 2, 2.0), (3, 2, 4.0),
                                                 (1, 1, 0.5)]] == [2.0, 1.0, 1.0, 1.5, 2.0]
    monkeypatch.setattr("cpchat.blas.cpu_allowance", lambda: 2.0)
    monkeypatch.setattr("cpchat.blas.in_use", lambda: BlasInfo("OpenBLAS", "", "", threads=1))
    calls = []

    def measure():
        calls.append(1)
        return COST, MEMORY

    alone = MeasureStore(tmp_path, ranks_here=1).measured("k", measure)
    four = MeasureStore(tmp_path, ranks_here=4).measured("k", measure)
    assert alone == (COST, MEMORY) and len(calls) == 1
    assert four == (PrefillCost(0.25, 0.125, 2.0**-29, 0.5, 2.0**-28), MEMORY)


def test_ranks_read_a_kept_measure_and_measure_again_when_old_or_damaged(tmp_path, monkeypatch, model_dir):
    """Real ranks of a user with no cache yet: the first load measures and keeps one entry (the ranks
    take turns: the first measures, the second reads its entry); a load after the entry
    was rewritten reports the rewritten cost (read, not measured); after it aged or was damaged, a
    measured one again, kept anew."""
    monkeypatch.setenv("XDG_CACHE_HOME", new_user(tmp_path)["XDG_CACHE_HOME"])
    path, other = str(model_dir("llama")), str(model_dir("qwen3"))
    cluster = Cluster.launch(2)
    try:
        cluster.connect()
        cluster.load(path)
        entries = list(measure_dir().glob("*.json"))
        assert len(entries) == 1
        measured = cluster.rank_costs[0]
        assert cluster.rank_costs == [measured, measured] and measured.per_token_s > 0  # the first kept
        entry = entries[0]
        entry.write_text(json.dumps({"prefill": COST.__dict__, "memory": MEMORY.__dict__}))
        cluster.load(other)
        assert len(list(measure_dir().glob("*.json"))) == 2
        cluster.load(path)
        shared = COST.scaled(oversubscription(2, shared_threads(2), cpu_allowance()))  # 1x on 2+ cores
        assert cluster.rank_costs == [shared, shared]
        assert [m.fixed_bytes for m in cluster.forward_memory] == [MEMORY.fixed_bytes] * 2
        old = time.time() - MAX_AGE_S - 60
        os.utime(entry, (old, old))
        cluster.load(path)
        assert COST not in cluster.rank_costs and time.time() - entry.stat().st_mtime < MAX_AGE_S
        entry.write_text("{")
        cluster.load(path)
        assert COST not in cluster.rank_costs
        assert json.loads(entry.read_text())["prefill"]["per_token_s"] > 0
    finally:
        cluster.close()
