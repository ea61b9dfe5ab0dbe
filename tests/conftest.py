"""Shared fixtures: small models built once per session, and rank clusters
started once per (ranks) and reset between tests. Property tests draw the
same examples on every run, so a red CI means a change broke something."""

from __future__ import annotations

import fcntl
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from hypothesis import settings

from cpchat.client.cluster import Cluster
from cpchat.core.quantized_kv import FULL_PRECISION, KVFormat
from cpchat.core.stages import ONE_STAGE, Stages
from cpchat.dirs import new_user
from cpchat.smallmodels import convert_model, write_model

ARCHS = ("llama", "mistral", "qwen2", "qwen3")
DEMO_MODEL = Path(__file__).resolve().parents[1] / "assets" / "demo-model"

settings.register_profile("cpchat", derandomize=True)
settings.load_profile("cpchat")


def pytest_report_header(config) -> str:
    import references

    store = references.STORE
    held = len(list(store.root.glob("*.json"))) if store.root.is_dir() else 0
    return f"mlx-lm references: {store.root} ({held} stored{'; computing all afresh' if store.fresh else ''})"


@contextmanager
def turn(exclusive: bool) -> Iterator[None]:
    """Under pytest-xdist, hold this run's lock: shared by ordinary tests, alone by a test marked `alone`
    (it measures speeds or detection deadlines, which the other worker's load would skew). One
    process: nothing to wait for."""
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    if run is None:
        yield
        return
    with open(Path(tempfile.gettempdir()) / f"cpchat-tests-{run}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    """Each test, with the module fixtures its setup and teardown start or stop, runs in its turn."""
    with turn(item.get_closest_marker("alone") is not None):
        return (yield)


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    """model_dir(arch) -> path of a small float32 model of that architecture (built once)."""
    root = tmp_path_factory.mktemp("models")
    built: dict[str, Path] = {}

    def get(arch: str = "llama") -> Path:
        if arch not in built:
            built[arch] = write_model(root / arch, arch, seed=ARCHS.index(arch) if arch in ARCHS else 0)
        return built[arch]

    return get


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory):
    """checkpoint(form) -> the trained demo model as people download checkpoints, made with
    mlx_lm.convert: "bfloat16" / "float16" from the shipped float32 weights, "q4g64" (bits, group
    size) quantized from the bfloat16 one, as published 4-bit models are. Trained weights give
    clear greedy choices, so identical tokens are a fair demand in low precision."""
    root = tmp_path_factory.mktemp("checkpoints")

    def get(form: str) -> Path:
        path = root / form
        if not path.exists():
            convert_model(DEMO_MODEL, path, form)
        return path

    return get


class ClusterPool:
    """One running cluster per (rank count, transport), with whichever model was loaded last."""

    def __init__(self) -> None:
        self.clusters: dict[tuple[int, str], Cluster] = {}
        self.loaded: dict[tuple[int, str], str] = {}

    def get(self, ranks: int, model: Path, transport: str = "auto", kv: KVFormat = FULL_PRECISION,
            stages: Stages = ONE_STAGE) -> Cluster:
        key = (ranks, transport)
        cluster = self.clusters.get(key)
        if cluster is None or any(r.local.process.poll() is not None for r in cluster.ranks):
            if cluster is not None:
                cluster.close()
            cluster = self.clusters[key] = Cluster.launch(ranks, transport=transport)
            cluster.connect()
            self.loaded.pop(key, None)
        if self.loaded.get(key) != (str(model), kv, stages):
            cluster.load(str(model), kv_format=kv, stages=stages)
            self.loaded[key] = (str(model), kv, stages)
        cluster.reset(0)
        return cluster

    def saved(self) -> None:
        """Wait until every running cluster's ranks have written the prefixes they are saving (a rank
        answers FindPrefixes once its saves under way are on disk)."""
        for cluster in self.clusters.values():
            if all(r.local.process.poll() is None for r in cluster.ranks):
                cluster.find_prefixes([0])

    def drop(self, ranks: int, transport: str = "auto") -> None:
        """Forget a cluster a test has broken on purpose."""
        cluster = self.clusters.pop((ranks, transport), None)
        self.loaded.pop((ranks, transport), None)
        if cluster is not None:
            cluster.close()

    def close(self) -> None:
        for cluster in self.clusters.values():
            cluster.close()


@pytest.fixture(scope="session")
def clusters():
    pool = ClusterPool()
    yield pool
    pool.close()


@pytest.fixture(autouse=True, scope="session")
def _isolated_user_dirs(tmp_path_factory):
    """Keep config, data and cache of the app under test out of the real home."""
    home = tmp_path_factory.mktemp("home")
    os.environ.update(new_user(home))
    yield home
