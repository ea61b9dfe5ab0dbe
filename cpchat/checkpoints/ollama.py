"""`ollama:NAME[:TAG]`: the GGUF blob of a model Ollama has pulled, found through its manifests.

Ollama keeps `manifests/<registry>/<namespace>/<model>/<tag>` (JSON listing the model's layers by
digest) and `blobs/sha256-<hex>` under `$OLLAMA_MODELS`, else `~/.ollama/models` (or the service's
`/usr/share/ollama/.ollama/models` on Linux). The model layer is a GGUF file; its chat template in
the GGUF's own metadata is the Jinja one cpchat uses (Ollama's Go template layer is not read).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from cpchat.checkpoints import CheckpointError

PREFIX = "ollama:"
REGISTRY, NAMESPACE, DEFAULT_TAG = "registry.ollama.ai", "library", "latest"
MODEL_LAYER = "application/vnd.ollama.image.model"
SERVICE_STORE = Path("/usr/share/ollama/.ollama/models")


def is_ollama(name: str) -> bool:
    return name.startswith(PREFIX)


def stores() -> list[Path]:
    """Where Ollama keeps models: $OLLAMA_MODELS alone when set."""
    if configured := os.environ.get("OLLAMA_MODELS"):
        return [Path(configured).expanduser()]
    return [Path.home() / ".ollama" / "models", SERVICE_STORE]


def manifest_path(name: str) -> Path:
    """`llama3.2:3b` -> manifests/registry.ollama.ai/library/llama3.2/3b (relative to a store)."""
    model, _, tag = name.partition(":")
    parts = model.split("/")
    if not model or len(parts) > 3 or not all(parts):
        raise CheckpointError(f"{PREFIX}{name} is not an Ollama model name (NAME[:TAG], e.g. llama3.2:3b)")
    if len(parts) == 1:
        parts = [NAMESPACE, *parts]
    if len(parts) == 2:
        parts = [REGISTRY, *parts]
    return Path("manifests", *parts, tag or DEFAULT_TAG)


def ollama_gguf(spec: str) -> Path:
    """The GGUF blob of `ollama:NAME[:TAG]` in the local store; CheckpointError (one line) when absent."""
    name = spec.removeprefix(PREFIX)
    relative = manifest_path(name)
    existing = [s for s in stores() if s.is_dir()]
    if not existing:
        raise CheckpointError(f"{spec}: no Ollama model store here ({', '.join(map(str, stores()))}); "
                              "set OLLAMA_MODELS to where Ollama keeps its models")
    store = next((s for s in existing if (s / relative).is_file()), None)
    if store is None:
        raise CheckpointError(f"{spec}: not in the Ollama store at {existing[0]} (`ollama pull {name}` "
                              "fetches it)")
    try:
        manifest = json.loads((store / relative).read_text(encoding="utf-8"))
        layer = next(x for x in manifest.get("layers", []) if x.get("mediaType") == MODEL_LAYER)
        algorithm, _, digest = layer["digest"].partition(":")
    except (OSError, ValueError, StopIteration, KeyError, AttributeError, TypeError):
        raise CheckpointError(f"{spec}: its manifest {store / relative} names no model layer") from None
    blob = store / "blobs" / f"{algorithm}-{digest}"
    if not blob.is_file():
        raise CheckpointError(f"{spec}: the manifest names {blob.name}, which is not in {store / 'blobs'}")
    return blob
