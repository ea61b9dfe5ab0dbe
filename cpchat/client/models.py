"""The models on this machine, for `cpchat --list-models` and the TUI's model picker: the Hugging
Face hub cache, mlx-lm directories and GGUF files in the model folders, Ollama's store, the named
models and the built-in demo. Each is described from its files alone (config.json and the
safetensors headers, or the GGUF header), without loading weights, and checked as far as the files
decide: complete, a model type mlx-lm has (the check `mlx_lm.load` makes on every rank), a GGUF
architecture cpchat converts (the converter's own check). What depends on the layers themselves
(window, sinks, state) a rank finds out when it loads the model, and refuses by name."""

from __future__ import annotations

import json
import math
import os
import re
import struct
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from cpchat.checkpoints import CheckpointError
from cpchat.checkpoints.named import NAMED
from cpchat.checkpoints.ollama import MODEL_LAYER, stores
from cpchat.client.settings import demo_model
from cpchat.core.stages import WeightParts
from cpchat.dirs import cache_dir
from cpchat.format import human_bytes, human_params

DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}  # safetensors' names, mlx-lm's
SOURCES = ("demo", "named", "hub", "folder", "gguf", "ollama")


@dataclass(frozen=True)
class LocalModel:
    name: str  # what --model takes ("" for the demo model)
    source: str  # one of SOURCES
    arch: str = ""  # mlx-lm's model_type (a GGUF's, as converted)
    params: int = 0  # 0: not known
    form: str = ""  # float32, bfloat16, 4-bit/g64, Q4_1, ...
    context: int = 0  # the config's max positions; 0: not known
    size_bytes: int = 0  # on disk; 0: not here yet (a named model downloads on first use)
    problem: str = ""  # why cpchat cannot run it; "" when it can, as far as the files say
    path: str = ""  # where it is, where that differs from the name

    @property
    def runs(self) -> bool:
        return not self.problem

    @property
    def label(self) -> str:
        return self.name or "demo"

    def as_json(self) -> dict:
        return asdict(self) | {"runs": self.runs}


def model_dirs(setting: str) -> list[Path]:
    """The model folders of a `model_dirs` setting (paths joined by the OS's path separator)."""
    return [Path(p).expanduser() for p in setting.split(os.pathsep) if p.strip()]


def local_models(folders: list[Path]) -> list[LocalModel]:
    """Every model found here: the demo first, then each source's models by name."""
    found = [demo(), *named_models(), *hub_models(hub_cache()), *folder_models(folders), *ollama_models()]
    unique = {m.name: m for m in reversed(found)}  # the first of one name wins
    return sorted(unique.values(), key=lambda m: (SOURCES.index(m.source), m.name.lower()))


# ---- the sources


def demo() -> LocalModel:
    path, _ = demo_model()
    return renamed(mlx_model(path, "demo"), "")


def named_models() -> Iterator[LocalModel]:
    """Named models: described from their GGUF once downloaded, else only named."""
    for name, named in NAMED.items():
        gguf = cache_dir() / "models" / name / Path(named.member).name
        if gguf.is_file():
            yield renamed(gguf_model(gguf, "named"), name)
        else:
            yield LocalModel(name, "named", path="downloads on first use")


def hub_cache() -> Path:
    """The hub cache huggingface_hub uses, read from the environment now (tests and users set it)."""
    if cache := os.environ.get("HF_HUB_CACHE"):
        return Path(cache).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME") or "~/.cache",
                                                      "huggingface")
    return Path(home).expanduser() / "hub"


def hub_models(cache: Path) -> Iterator[LocalModel]:
    """Model repositories in the hub cache, at the snapshot `main` points to (else the newest)."""
    for repo in sorted(cache.glob("models--*--*")):
        snapshots = [s for s in (repo / "snapshots").glob("*") if s.is_dir()]
        main = repo / "refs" / "main"
        commit = main.read_text().strip() if main.is_file() else ""
        newest = max(snapshots, key=os.path.getmtime, default=None)
        snapshot = repo / "snapshots" / commit if commit else newest
        if snapshot is None or not snapshot.is_dir() or not (snapshot / "config.json").exists():
            continue  # a dataset, a tokenizer alone, or nothing fetched yet
        name = "/".join(repo.name.split("--")[1:])
        model = mlx_model(snapshot, "hub", name)
        if any((repo / "blobs").glob("*.incomplete")) and model.runs:
            model = replace(model, problem="incomplete: a download did not finish")
        yield model


def folder_models(folders: list[Path]) -> Iterator[LocalModel]:
    """mlx-lm directories and GGUF files in each folder and one level below."""
    for folder in folders:
        if not folder.is_dir():
            continue
        for entry in sorted(folder.iterdir()):
            if (entry / "config.json").is_file():
                yield mlx_model(entry, "folder", str(entry))
            elif entry.suffix.lower() == ".gguf" and entry.is_file():
                yield gguf_model(entry, "gguf")
            elif entry.is_dir():
                yield from (gguf_model(f, "gguf") for f in sorted(entry.glob("*.gguf")) if f.is_file())


def ollama_models() -> Iterator[LocalModel]:
    """Ollama's pulled models, from the manifests of each store."""
    for store in stores():
        manifests = store / "manifests"
        for manifest in sorted(manifests.glob("*/*/*/*")) if manifests.is_dir() else ():
            registry, namespace, model, tag = manifest.relative_to(manifests).parts
            name = model if namespace == "library" else f"{namespace}/{model}"
            try:
                layers = json.loads(manifest.read_text(encoding="utf-8")).get("layers", [])
                digest = next(x["digest"] for x in layers if x.get("mediaType") == MODEL_LAYER)
            except (OSError, ValueError, StopIteration, KeyError, AttributeError, TypeError):
                continue  # not a model's manifest
            blob = store / "blobs" / digest.replace(":", "-")
            spec = f"ollama:{name}:{tag}"
            if blob.is_file():
                yield renamed(gguf_model(blob, "ollama"), spec)
            else:
                yield LocalModel(spec, "ollama", problem=f"incomplete: its blob {blob.name} is missing")


# ---- reading one model's files


def mlx_model(directory: Path, source: str, name: str | None = None) -> LocalModel:
    """An mlx-lm (Hugging Face layout) directory, from config.json and its safetensors headers."""
    name = str(directory) if name is None else name
    try:
        config = json.loads((directory / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        return LocalModel(name, source, path=str(directory), problem=f"unreadable config.json: {e}")
    text = config.get("text_config") or {}
    arch = str(config.get("model_type", ""))
    quant = config.get("quantization") or {}
    weights, missing = weight_files(directory)
    params, dtypes = tensor_counts(weights, quant.get("bits"))
    stored = max(dtypes, key=dtypes.get, default="")  # the dtype most weights are stored in
    form = (f"{quant['bits']}-bit/g{quant.get('group_size', 64)}" if "bits" in quant
            else str(config.get("torch_dtype") or config.get("dtype") or stored))
    problem = ""
    if missing:
        problem = f"incomplete: {len(missing)} of {len(missing) + len(weights)} weight files missing"
    elif not weights:
        problem = "no safetensors weights"
    else:
        problem = mlx_lm_refusal(config)
    return LocalModel(name, source, arch, params, form,
                      int(config.get("max_position_embeddings") or text.get("max_position_embeddings") or 0),
                      sum(f.stat().st_size for f in directory.iterdir() if f.is_file()), problem,
                      "" if name == str(directory) else str(directory))


def weight_files(directory: Path) -> tuple[list[Path], list[str]]:
    """The model's safetensors files, and those its index names that are not here."""
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()))
        except (OSError, ValueError, KeyError, AttributeError):
            return [], ["model.safetensors.index.json"]
        return [directory / n for n in names if (directory / n).is_file()], [
            n for n in names if not (directory / n).is_file()]
    return sorted(f for f in directory.glob("model*.safetensors") if f.is_file()), []


def tensors(files: list[Path]) -> Iterator[tuple[str, dict]]:
    """Each tensor's name and header entry (dtype, shape, data_offsets) in these safetensors files."""
    for file in files:
        try:
            with file.open("rb") as f:
                (length,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(length))
        except (OSError, ValueError, struct.error):
            continue
        yield from ((key, tensor) for key, tensor in header.items() if key != "__metadata__")


def weight_parts(directory: Path) -> WeightParts:
    """The bytes of each layer's weights, of the embedding and of the rest (final norm, head), from
    the safetensors headers of an mlx-lm directory."""
    return parts_by_name((name, tensor["data_offsets"][1] - tensor["data_offsets"][0])
                         for name, tensor in tensors(weight_files(directory)[0]))


def parts_by_name(sizes: Iterable[tuple[str, int]]) -> WeightParts:
    """WeightParts from each weight's name (as mlx-lm names them) and bytes."""
    layers: dict[int, int] = {}
    embedding = rest = 0
    head = False
    for name, size in sizes:
        if match := re.search(r"\blayers\.(\d+)\.", name):
            layers[int(match[1])] = layers.get(int(match[1]), 0) + size
        elif "embed" in name:
            embedding += size
        else:
            rest += size
            head = head or "head" in name or name.startswith("output.")
    return WeightParts([layers.get(i, 0) for i in range(max(layers, default=-1) + 1)], embedding, rest,
                       tied=not head)


def tensor_counts(files: list[Path], bits: int | None) -> tuple[int, dict[str, int]]:
    """Parameters (a quantized weight's packed words counted as the values they hold; its scales and
    biases not) and elements per dtype, from the safetensors headers."""
    params, dtypes = 0, {}
    for key, tensor in tensors(files):
        if key.endswith((".scales", ".biases")):
            continue
        count = math.prod(tensor["shape"])
        if bits and tensor["dtype"] == "U32":
            count = count * 32 // bits
        params += count
        kind = DTYPES.get(tensor["dtype"], tensor["dtype"])
        dtypes[kind] = dtypes.get(kind, 0) + count
    return params, dtypes


def mlx_lm_refusal(config: dict) -> str:
    """Why mlx-lm (on every rank) would refuse this config's model type: its own check."""
    from mlx_lm.utils import _get_classes

    if "model_type" not in config:
        return "config.json names no model_type"
    try:
        _get_classes(config)
    except ValueError:
        return f"mlx-lm {_mlx_lm_version()} has no model type {config['model_type']!r}"
    return ""


def gguf_model(path: Path, source: str) -> LocalModel:
    """A GGUF file, from its header; its architecture checked as the converter checks it."""
    from cpchat.checkpoints.gguf_config import mlx_config
    from cpchat.checkpoints.gguf_file import read_gguf

    size = path.stat().st_size
    try:
        f = read_gguf(path)
    except CheckpointError as e:
        return LocalModel(str(path), source, size_bytes=size, problem=str(e))
    try:
        params = sum(math.prod(t.shape) for t in f.tensors.values())
        kinds: dict[str, int] = {}
        for t in f.tensors.values():
            if len(t.shape) > 1:  # the weight matrices' type names the form; norms stay float32
                kinds[t.ggml_type.name] = kinds.get(t.ggml_type.name, 0) + math.prod(t.shape)
        try:
            config = mlx_config(f)
            arch, problem = config["model_type"], mlx_lm_refusal(config)
        except CheckpointError as e:
            arch, problem = f.architecture, str(e).split(": ", 1)[-1]
        return LocalModel(str(path), source, arch, params, max(kinds, key=kinds.get, default=""),
                          int(f.get("context_length") or 0), size, problem)
    finally:
        f.close()


def _mlx_lm_version() -> str:
    from importlib.metadata import version

    return version("mlx-lm")


def renamed(model: LocalModel, name: str) -> LocalModel:
    """`model` under the name --model takes for it, its file kept as its path."""
    return replace(model, name=name, path=model.path or model.name)


# ---- the table


def table_rows(models: list[LocalModel]) -> list[tuple[str, ...]]:
    """Model, source, arch, params, form, context, size, and whether it runs (or why not)."""
    return [(m.label, m.source, m.arch or "?", human_params(m.params), m.form or "?",
             f"{m.context:,}" if m.context else "?", human_bytes(m.size_bytes) if m.size_bytes else "-",
             "yes" if m.runs else f"no: {m.problem}") for m in models]


HEADER = ("MODEL", "SOURCE", "ARCH", "PARAMS", "FORM", "CONTEXT", "SIZE", "RUNS")


def format_table(models: list[LocalModel]) -> str:
    rows = [HEADER, *table_rows(models)]
    widths = [max(len(r[i]) for r in rows) for i in range(len(HEADER) - 1)]
    return "\n".join("  ".join([*(c.ljust(w) for c, w in zip(r, widths, strict=False)), r[-1]]).rstrip()
                     for r in rows)
