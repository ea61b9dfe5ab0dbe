"""Models named by hub id (`ORG/NAME`, `ORG/NAME@revision`), resolved as `mlx_lm.load` does:
from the local hub cache when they are there (so `HF_HUB_OFFLINE=1` works), else downloaded.

The front end fetches what it needs itself (the tokenizer, or the whole model for local ranks so
that they find it in the cache); every rank resolves the id on its own machine.
"""

from __future__ import annotations

import io
import re
from collections.abc import Callable
from pathlib import Path

from cpchat.checkpoints import CheckpointError
from cpchat.checkpoints.resolve import Report, is_checkpoint, model_dir
from cpchat.errors import BadInput

# What mlx-lm downloads for a model (mlx_lm.utils.DEFAULT_ALLOW_PATTERNS), and its tokenizer part.
MODEL_FILES = ["*.json", "model*.safetensors", "*.py", "tokenizer.model", "*.tiktoken", "tiktoken.model",
               "*.txt", "*.jsonl", "*.jinja"]
TOKENIZER_FILES = ["*.json", "tokenizer.model", "*.tiktoken", "tiktoken.model", "*.txt", "*.jinja"]
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+(@[\w./-]+)?$")


def is_hub_id(name: str) -> bool:
    return bool(_HUB_ID.match(name)) and not name.startswith((".", "~"))


def split_revision(name: str) -> tuple[str, str | None]:
    repo, _, revision = name.partition("@")
    return repo, revision or None


def front_end_copy(model: str, whole_model: bool, report: Report | None = None,
                   say: Callable[[str], None] | None = None) -> str:
    """The directory the front end reads `model` (from `resolve_model`) from: a local directory as it
    is; for a hub id, the cached snapshot — the whole model when the ranks are local (they then find it
    in the same cache), else only the tokenizer; for a checkpoint (GGUF), its conversion, likewise.
    `report(phase, done, total)` follows a download ("download", bytes) or a conversion ("convert",
    tensors); `say` takes the converter's lines."""
    if is_checkpoint(model):
        try:
            return str(model_dir(model, tokenizer_only=not whole_model, report=report, say=say))
        except CheckpointError as e:
            raise BadInput(str(e)) from None
    if Path(model).is_absolute():
        return model
    progress = None if report is None else (lambda done, total: report("download", done, total))
    return str(fetch(model, tokenizer_only=not whole_model, progress=progress))


def fetch(name: str, tokenizer_only: bool = False,
          progress: Callable[[int, int], None] | None = None) -> Path:
    """The local snapshot directory of a hub model, downloading what the cache lacks.
    `progress(bytes_done, bytes_total)` follows a download; without it huggingface_hub draws its
    own progress bars on stderr."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HFValidationError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    repo, revision = split_revision(name)
    patterns = TOKENIZER_FILES if tokenizer_only else MODEL_FILES
    try:
        try:
            return Path(snapshot_download(repo, revision=revision, allow_patterns=patterns,
                                          local_files_only=True))
        except LocalEntryNotFoundError:
            pass
        bar = _progress_bar(progress) if progress else None
        return Path(snapshot_download(repo, revision=revision, allow_patterns=patterns, tqdm_class=bar))
    except GatedRepoError:
        raise BadInput(f"model {name} is gated: accept its terms on the hub, then log in") from None
    except RepositoryNotFoundError:
        raise BadInput(f"model {name} was not found on the hub (or it is private: log in)") from None
    except RevisionNotFoundError:
        raise BadInput(f"model {repo} has no revision {revision!r}") from None
    except LocalEntryNotFoundError:
        raise BadInput(f"model {name} is not in the local hub cache, and downloads are off "
                       "(HF_HUB_OFFLINE) or the hub cannot be reached") from None
    except HFValidationError as e:
        raise BadInput(f"model {name!r} is not a valid hub id: {e}") from None
    except OSError as e:
        raise BadInput(f"cannot download model {name}: {e}") from None


def _progress_bar(report: Callable[[int, int], None]):
    """A tqdm class that reports bytes to `report` instead of drawing."""
    from tqdm.auto import tqdm

    class Reported(tqdm):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **{**kwargs, "disable": False, "file": io.StringIO()})

        def update(self, n=1):
            super().update(n)
            if self.unit == "B":
                report(int(self.n), int(self.total or 0))

    return Reported
