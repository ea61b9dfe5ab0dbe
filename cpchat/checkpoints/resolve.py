"""Model names that are checkpoints to convert: a `.gguf` file, `ollama:NAME[:TAG]`, or a named model
(`smollm2`). Each resolves on the machine that runs it, into that machine's cache."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

from cpchat.checkpoints import CheckpointError
from cpchat.checkpoints.named import NAMED, named_gguf
from cpchat.checkpoints.ollama import is_ollama, ollama_gguf
from cpchat.dirs import cache_dir

Report = Callable[[str, int, int], None]  # (phase: "download" bytes | "convert" tensors, done, total)


def is_checkpoint(name: str) -> bool:
    return name.lower().endswith(".gguf") or is_ollama(name) or name in NAMED


def local_gguf(name: str, report: Report | None = None) -> Path:
    """The GGUF file `name` stands for here, fetching a named model first."""
    if name in NAMED:
        return named_gguf(name, cache_dir() / "models", _phase(report, "download"))
    if is_ollama(name):
        return ollama_gguf(name)
    path = Path(name).expanduser()
    if not path.is_file():
        raise CheckpointError(f"model file {name} does not exist")
    return path


def model_dir(name: str, tokenizer_only: bool = False, report: Report | None = None,
              say: Callable[[str], None] | None = None) -> Path:
    """The mlx-lm directory for checkpoint `name`, converted into this machine's cache when needed."""
    from cpchat.checkpoints.gguf_convert import converted_dir  # MLX: only where a model is made

    gguf = local_gguf(name, report)
    label = name.removeprefix("ollama:").replace("/", "-").replace(":", "-") if is_ollama(name) else None
    return converted_dir(gguf, cache_dir() / "models" / "gguf", tokenizer_only, label,
                         _phase(report, "convert"), say)


class DownloadLines:
    """A named model's download on stderr (a Report): a line as it starts, one when done."""

    def __init__(self) -> None:
        self.started = False

    def __call__(self, phase: str, done: int, total: int) -> None:
        if phase == "download" and (done == total or not self.started):
            self.started = True
            state = "downloaded" if done == total else "downloading"
            print(f"cpchat: model {state}: {done >> 20}/{total >> 20} MiB", file=sys.stderr, flush=True)


def _phase(report: Report | None, phase: str) -> Callable[[int, int], None] | None:
    return None if report is None else (lambda done, total: report(phase, done, total))
