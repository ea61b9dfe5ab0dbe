"""Models named by hub id, resolved as mlx_lm.load does: offline from a hub cache laid out on disk
(HF_HOME, HF_HUB_OFFLINE=1) through real ranks, with revisions; the download itself is stubbed."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from helpers import one_line_error, run
from references import reference_generate, reference_tokenizer

from cpchat.client import hub
from cpchat.errors import BadInput

MAIN, V2 = "1" * 40, "2" * 40  # commit hashes of two snapshots


@pytest.fixture(scope="module")
def hub_home(tmp_path_factory, model_dir):
    """HF_HOME with acme/tiny-chat cached: `main` is a llama, the `v2` tag a qwen3."""
    home = tmp_path_factory.mktemp("hf-home")
    repo = home / "hub" / "models--acme--tiny-chat"
    for commit, arch in ((MAIN, "llama"), (V2, "qwen3")):
        shutil.copytree(model_dir(arch), repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(MAIN)
    (repo / "refs" / "v2").write_text(V2)
    return home


@pytest.fixture
def offline(hub_home, monkeypatch):
    """The front end and its ranks see only the cache on disk."""
    monkeypatch.setenv("HF_HOME", str(hub_home))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


@pytest.mark.slow
@pytest.mark.parametrize("name, arch", [("acme/tiny-chat", "llama"), ("acme/tiny-chat@v2", "qwen3"),
                                        (f"acme/tiny-chat@{V2}", "qwen3")])
def test_hub_id_from_the_cache_through_ranks(offline, model_dir, name, arch):
    prompt = "The quick brown fox"
    result = run(["--headless", "--json", "--raw", "--model", name, "--ranks", "2", "--max-tokens", "5",
                  "--prompt", prompt])
    assert result.returncode == 0, result.stderr
    events = [json.loads(line) for line in result.stdout.splitlines()]
    assert events[0] == {**events[0], "event": "ready", "model": name}
    ids = reference_tokenizer(model_dir(arch)).encode(prompt, add_special_tokens=False)
    expected = reference_generate(model_dir(arch), ids, 5)
    assert [e["id"] for e in events if e["event"] == "token"] == [t for t, _ in expected]


@pytest.mark.parametrize("name", ["acme/absent", "acme/tiny-chat@v9"])
def test_missing_hub_model_is_one_line_and_exit_2(offline, name):
    result = run(["--headless", "--model", name, "--prompt", "hi"], timeout=60)
    one_line_error(result, 2, f"{name} is not in the local hub cache")


def test_download_reports_progress_and_lands_in_the_cache(tmp_path, model_dir, monkeypatch):
    """A model missing from the cache is downloaded (the one stubbed part: the network), with byte
    progress for the TUI, and only the tokenizer's files when the ranks are remote."""
    import huggingface_hub
    from huggingface_hub.errors import LocalEntryNotFoundError

    calls, reports = [], []

    def snapshot_download(repo, revision=None, allow_patterns=None, local_files_only=False, tqdm_class=None):
        calls.append((repo, revision, tuple(allow_patterns), local_files_only))
        if local_files_only:
            raise LocalEntryNotFoundError("not cached")
        bar = tqdm_class(total=300, unit="B")
        bar.update(100)
        bar.update(200)
        bar.close()
        target = tmp_path / "snapshot"
        shutil.copytree(model_dir("llama"), target, dirs_exist_ok=True)
        return str(target)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    path = hub.front_end_copy("acme/new@v1", whole_model=False, report=lambda *p: reports.append(p))
    assert Path(path, "tokenizer.json").exists()
    assert [c[3] for c in calls] == [True, False] and calls[1][:2] == ("acme/new", "v1")
    assert "model*.safetensors" not in calls[1][2] and "tokenizer.model" in calls[1][2]
    assert reports == [("download", 100, 300), ("download", 300, 300)]
    hub.front_end_copy("acme/new", whole_model=True, report=lambda *p: None)
    assert "model*.safetensors" in calls[-1][2]


@pytest.mark.parametrize("error, words", [("GatedRepoError", "is gated"),
                                          ("RepositoryNotFoundError", "not found"),
                                          ("RevisionNotFoundError", "no revision 'v1'")])
def test_hub_refusals_are_one_clear_line(error, words, monkeypatch):
    import httpx2
    import huggingface_hub
    from huggingface_hub import errors

    def snapshot_download(*args, **kwargs):
        response = httpx2.Response(404, request=httpx2.Request("GET", "https://hub.invalid/x"))
        raise getattr(errors, error)("refused", response=response)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    with pytest.raises(BadInput, match=words) as refusal:
        hub.fetch("acme/new@v1")
    assert "\n" not in str(refusal.value)


def test_hub_ids_and_paths_are_told_apart(tmp_path):
    assert hub.is_hub_id("mlx-community/Qwen3-4B-4bit") and hub.is_hub_id("org/name@main")
    assert not hub.is_hub_id("./models/x") and not hub.is_hub_id("/abs/path") and not hub.is_hub_id("a/b/c")
    assert hub.front_end_copy(str(tmp_path), whole_model=True) == str(tmp_path)
