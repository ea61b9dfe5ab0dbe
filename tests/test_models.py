"""The models on this machine (`cpchat --list-models`, the TUI's picker), found in a hub cache, a
model folder, GGUF files and an Ollama store laid out on disk, each described from its files and
checked as a rank's load would check it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from ggufs import write_foreign_gguf, write_gguf
from textual.widgets import OptionList

from cpchat.client.models import LocalModel, format_table, local_models, model_dirs
from cpchat.client.settings import Settings
from cpchat.tui.app import CpchatApp
from cpchat.tui.chat import ChatScreen
from cpchat.tui.screens import ModelPicker
from cpchat.tui.widgets import ChatInput


@pytest.fixture(scope="module")
def machine(tmp_path_factory, model_dir, checkpoint):
    """A hub cache (a complete model, one missing a weight shard, one of a type mlx-lm lacks), a model
    folder (a bfloat16 mlx-lm directory, a GGUF, a GGUF of another architecture) and an Ollama store."""
    root = tmp_path_factory.mktemp("machine")
    hub = root / "hub"

    def cached(repo: str, source: Path) -> Path:
        commit = "1" * 40
        snapshot = hub / f"models--{repo.replace('/', '--')}" / "snapshots" / commit
        shutil.copytree(source, snapshot)
        (snapshot.parents[1] / "refs").mkdir()
        (snapshot.parents[1] / "refs" / "main").write_text(commit)
        return snapshot

    cached("acme/tiny-chat", model_dir("llama"))
    sharded = cached("acme/sharded", model_dir("qwen3"))
    (sharded / "model.safetensors").rename(sharded / "model-00001-of-00002.safetensors")
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        "a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}))
    strange = cached("acme/strange", model_dir("llama"))
    config = json.loads((strange / "config.json").read_text())
    (strange / "config.json").write_text(json.dumps({**config, "model_type": "no_such_family"}))

    folder = root / "models"
    shutil.copytree(checkpoint("bfloat16"), folder / "demo-bf16")
    write_gguf(model_dir("llama"), folder / "llama-q8.gguf", "Q8_0")
    (folder / "more").mkdir()
    write_foreign_gguf(folder / "more" / "bert.gguf")

    ollama = root / "ollama"
    blob = ollama / "blobs" / ("sha256-" + "a" * 64)
    blob.parent.mkdir(parents=True)
    shutil.copy(folder / "llama-q8.gguf", blob)
    manifest = ollama / "manifests" / "registry.ollama.ai" / "library" / "tiny" / "latest"
    manifest.parent.mkdir(parents=True)
    manifest.write_text(json.dumps({"layers": [{"mediaType": "application/vnd.ollama.image.model",
                                                "digest": "sha256:" + "a" * 64}]}))
    return root


@pytest.fixture
def on_machine(machine, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(machine / "hub"))
    monkeypatch.setenv("OLLAMA_MODELS", str(machine / "ollama"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(machine / "cache"))  # nothing fetched yet, whatever ran before
    return machine


def by_name(models: list[LocalModel]) -> dict[str, LocalModel]:
    return {m.name: m for m in models}


def test_every_source_is_listed_and_described_from_its_files(on_machine, model_dir):
    models = local_models([on_machine / "models"])
    found = by_name(models)
    assert [m.source for m in models][:2] == ["demo", "named"], "the demo first, then smollm2"
    assert found[""].runs and found[""].arch == "llama" and found[""].params > 0
    assert found["smollm2"].path == "downloads on first use" and found["smollm2"].runs

    tiny = found["acme/tiny-chat"]
    config = json.loads((model_dir("llama") / "config.json").read_text())
    assert (tiny.source, tiny.arch, tiny.form, tiny.context) == ("hub", "llama", "float32",
                                                                config["max_position_embeddings"])
    assert tiny.runs and tiny.size_bytes >= (model_dir("llama") / "model.safetensors").stat().st_size

    bf16 = found[str(on_machine / "models" / "demo-bf16")]
    assert (bf16.source, bf16.form, bf16.runs) == ("folder", "bfloat16", True)
    assert bf16.params == found[""].params, "the same weights as the demo, in another dtype"

    q8 = found[str(on_machine / "models" / "llama-q8.gguf")]
    assert (q8.source, q8.arch, q8.form, q8.runs) == ("gguf", "llama", "Q8_0", True)
    assert q8.params == tiny.params, "the same model as acme/tiny-chat, written as a GGUF"
    assert found["ollama:tiny:latest"].form == "Q8_0" and found["ollama:tiny:latest"].runs


def test_what_cannot_run_says_why(on_machine):
    found = by_name(local_models([on_machine / "models"]))
    assert found["acme/sharded"].problem == "incomplete: 1 of 2 weight files missing"
    assert "has no model type 'no_such_family'" in found["acme/strange"].problem
    bert = found[str(on_machine / "models" / "more" / "bert.gguf")]
    assert bert.arch == "bert" and "architecture 'bert' is not one cpchat converts" in bert.problem
    assert sum(not m.runs for m in found.values()) == 3


@pytest.mark.slow
def test_list_models_prints_the_table_and_json_lines(on_machine):
    env = {**os.environ, "HF_HUB_CACHE": str(on_machine / "hub"), "OLLAMA_MODELS": str(on_machine / "ollama"),
           "CPCHAT_MODEL_DIRS": str(on_machine / "models")}
    table = subprocess.run([sys.executable, "-m", "cpchat", "--list-models"], capture_output=True, text=True,
                           env=env, timeout=120)
    assert table.returncode == 0, table.stderr
    lines = table.stdout.splitlines()
    assert lines[0].split() == ["MODEL", "SOURCE", "ARCH", "PARAMS", "FORM", "CONTEXT", "SIZE", "RUNS"]
    tiny = next(line for line in lines if line.startswith("acme/tiny-chat "))
    assert tiny.split()[1:3] == ["hub", "llama"] and tiny.split()[-1] == "yes"
    sharded = next(line for line in lines if line.startswith("acme/sharded "))
    assert sharded.endswith("no: incomplete: 1 of 2 weight files missing")
    rows = subprocess.run([sys.executable, "-m", "cpchat", "--list-models", "--json"], capture_output=True,
                          text=True, env=env, timeout=120)
    models = [json.loads(line) for line in rows.stdout.splitlines()]
    assert rows.returncode == 0 and len(models) == len(lines) - 1
    assert {m["name"]: m["runs"] for m in models}["ollama:tiny:latest"] is True
    assert str(on_machine / "models" / "demo-bf16") in {m["name"] for m in models}


def test_model_folders_come_from_the_setting(tmp_path):
    assert model_dirs(os.pathsep.join(["~/models", str(tmp_path)])) == [Path.home() / "models", tmp_path]
    assert format_table([LocalModel("x", "folder", problem="why")]).splitlines()[1].endswith("no: why")


class PickingChat(ChatScreen):
    """The chat with a stand-in for loaded ranks; the model switch it would start is recorded."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.switched: list[str] = []
        self.backend.cluster = SimpleNamespace(model=SimpleNamespace(name="acme/tiny-chat"), is_local=True)

    def switch_model(self, model: str) -> None:  # the worker
        self.switched.append(model)


class PickingApp(CpchatApp):
    CHAT_SCREEN = PickingChat


async def until(pilot, condition, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await pilot.pause(0.05)


@pytest.mark.slow
@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_the_model_picker_lists_them_greys_what_cannot_run_and_filters(on_machine, tmp_path):
    settings = Settings(model_dirs=str(on_machine / "models"))
    app = PickingApp(settings, start_backend=False, transcripts=tmp_path / "transcripts")
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.pause()
        app.query_one(ChatInput).load_text("/model")
        app.query_one(ChatInput).focus()
        await pilot.press("enter")
        await until(pilot, lambda: isinstance(app.screen, ModelPicker) and app.screen.models is not None,
                    "the picker's list")
        picker, options = app.screen, app.screen.query_one(OptionList)
        assert len(picker.shown) == len(local_models([on_machine / "models"])) == options.option_count
        refused = [m for m in picker.shown if not m.runs]
        assert {m.name for m in refused} >= {"acme/sharded", "acme/strange"}
        for i, model in enumerate(picker.shown):
            option = options.get_option_at_index(i)
            assert option.disabled == (not model.runs)
            assert ("cannot run: " in str(option.prompt)) == (not model.runs)
        assert "acme/tiny-chat (running)" in str(options.get_option_at_index(
            [m.name for m in picker.shown].index("acme/tiny-chat")).prompt)

        await pilot.press(*"shard")  # a fuzzy filter: only the sharded one, which cannot be chosen
        await until(pilot, lambda: [m.name for m in picker.shown] == ["acme/sharded"], "the filter")
        assert options.highlighted is None
        await pilot.press(*["backspace"] * 5, *"q8")
        await until(pilot, lambda: picker.shown and picker.shown[0].name.endswith("llama-q8.gguf"), "q8")
        await pilot.press("enter")
        await until(pilot, lambda: app.screen is app.chat, "the chat again")
        assert app.chat.switched == [str(on_machine / "models" / "llama-q8.gguf")]

        app.chat.busy = False
        app.chat.action_switch_model()
        await until(pilot, lambda: isinstance(app.screen, ModelPicker), "the picker again")
        await pilot.press(*"acme/not-here", "enter")  # nothing matches: what was typed is loaded
        await until(pilot, lambda: app.screen is app.chat, "the chat again")
        assert app.chat.switched[-1] == "acme/not-here"
