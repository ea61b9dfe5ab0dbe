"""Settings: built-in defaults < config file < CPCHAT_* environment < flags.

The config file is TOML at <user config dir>/cpchat/config.toml, e.g.

    model = "~/models/Qwen3-4B-4bit"
    ranks = 4
    algorithm = "auto"
    max_tokens = 512
    temp = 0.0
    theme = "textual-dark"
    model_dirs = ["~/models", "/data/models"]   # where the model picker looks
"""

from __future__ import annotations

import argparse
import os
import tomllib
from dataclasses import dataclass, field, fields
from pathlib import Path

from cpchat import blas
from cpchat.checkpoints import CheckpointError
from cpchat.checkpoints.named import NAMED
from cpchat.checkpoints.ollama import is_ollama
from cpchat.checkpoints.resolve import is_checkpoint, local_gguf
from cpchat.client.hub import is_hub_id
from cpchat.core.algorithms import ALGORITHMS
from cpchat.core.lookup import MAX_DRAFT, SPECULATE, speculation_valid
from cpchat.core.quantized_kv import BITS, GROUP_SIZES, QUANTIZED_KV_START, KVFormat
from cpchat.core.sharding import Shares, integer_shares
from cpchat.core.stages import Stages, parse_stages
from cpchat.dirs import PREFIX_CACHE_GB, cache_dir, config_dir, data_dir
from cpchat.errors import BadInput

REPO_ASSETS = Path(__file__).resolve().parents[2] / "assets"
INSTALLED_ASSETS = Path(__file__).resolve().parents[1] / "bundled"  # assets/ as the wheel maps it


def bundled(name: str) -> Path:
    """A file cpchat ships (the demo model, the sample document): where the installed package
    carries it, or in assets/ of a source checkout."""
    installed = INSTALLED_ASSETS / name
    return installed if installed.exists() else REPO_ASSETS / name


@dataclass
class Settings:
    model: str = ""
    ranks: int = 2
    algorithm: str = "auto"
    shares: str = "auto"  # each rank's share of a prompt: auto (by measured speed) | equal | W1,W2,...
    max_tokens: int = 256
    temp: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    theme: str = "textual-dark"
    blas: str = "auto"  # for local ranks: auto | openblas | mkl | reference (cpchat/blas.py)
    threads: int = 0  # BLAS threads per local rank; 0: the cores shared out between them
    cache: bool = True  # the prefix cache: ranks save conversations on disk and later sessions reuse them
    cache_dir: str = ""  # where local ranks keep it ("": <user cache dir>/cpchat/prefix)
    cache_max_gb: float = PREFIX_CACHE_GB  # per rank
    stages: str = "1"  # pipeline stages the ranks form: P | auto | layer counts L1,L2,... (--stages)
    kv_bits: int = 0  # K/V quantized to 4 or 8 bits (mlx-lm's --kv-bits); 0: the model's dtype
    kv_group_size: int = 64
    quantized_kv_start: int = QUANTIZED_KV_START
    speculate: str = "auto"  # speculative decoding: off | lookup | auto (cpchat/core/lookup.py)
    draft_tokens: int = 0  # tokens proposed a step; 0: adaptive
    model_dirs: str = "~/models"  # folders of models for the picker, joined by os.pathsep
    sources: dict[str, str] = field(default_factory=dict)

    @property
    def kv_format(self) -> KVFormat:
        return KVFormat(self.kv_bits, self.kv_group_size, self.quantized_kv_start)

    @property
    def stage_split(self) -> Stages:
        return parse_stages(self.stages)


def parse_shares(text: str) -> Shares | str:
    """--shares: "auto", "equal", or weights "W1,W2,..." as integer shares."""
    if text in ("auto", "equal"):
        return text
    return integer_shares([float(w) for w in text.split(",")])


def _flag(value: object) -> bool:
    """A TOML boolean, or true/false, yes/no, on/off, 1/0 from the environment."""
    if isinstance(value, bool):
        return value
    word = str(value).lower()
    if word not in ("1", "true", "yes", "on", "0", "false", "no", "off"):
        raise ValueError(value)
    return word in ("1", "true", "yes", "on")


def _folders(value: object) -> str:
    """Folders as a TOML list, or one string joined by the OS's path separator (the environment)."""
    return os.pathsep.join(map(str, value)) if isinstance(value, list) else str(value)


_KEYS = {f.name: f.type for f in fields(Settings) if f.name != "sources"}
_CASTS = {
    "model": str,
    "ranks": int,
    "algorithm": str,
    "shares": str,
    "stages": str,
    "max_tokens": int,
    "temp": float,
    "top_p": float,
    "seed": int,
    "theme": str,
    "blas": str,
    "threads": int,
    "cache": _flag,
    "cache_dir": str,
    "cache_max_gb": float,
    "kv_bits": int,
    "kv_group_size": int,
    "quantized_kv_start": int,
    "speculate": str,
    "draft_tokens": int,
    "model_dirs": _folders,
}


def _set(settings: Settings, key: str, value: object, source: str) -> None:
    try:
        value = _CASTS[key](value)
    except (TypeError, ValueError):
        kind = "true or false" if key == "cache" else f"a valid {_CASTS[key].__name__}"
        raise BadInput(f"setting {key} from {source}: {value!r} is not {kind}") from None
    if key == "algorithm" and value not in ALGORITHMS:
        raise BadInput(f"setting algorithm from {source}: {value!r} is not {', '.join(ALGORITHMS)}")
    if key == "shares":
        try:
            parse_shares(value)
        except ValueError:
            raise BadInput(f"setting shares from {source}: {value!r} is not auto, equal or "
                           "positive weights W1,W2,... (one a rank)") from None
    if key == "stages":
        try:
            parse_stages(value)
        except ValueError as e:
            raise BadInput(f"setting stages from {source}: {e}") from None
    if key == "blas" and value not in blas.CHOICES:
        raise BadInput(f"setting blas from {source}: {value!r} is not {', '.join(blas.CHOICES)}")
    if key == "cache_max_gb" and value < 0:
        raise BadInput(f"setting cache_max_gb from {source}: cannot be negative")
    if key == "kv_bits" and value not in (0, *BITS):
        raise BadInput(f"setting kv_bits from {source}: {value} is not 0 (off), 4 or 8")
    if key == "kv_group_size" and value not in GROUP_SIZES:
        raise BadInput(f"setting kv_group_size from {source}: {value} is not 32, 64 or 128")
    if key == "quantized_kv_start" and value < 0:
        raise BadInput(f"setting quantized_kv_start from {source}: cannot be negative")
    if key == "threads" and value < 0:
        raise BadInput(f"setting threads from {source}: cannot be negative (0: share the cores out)")
    if key == "speculate" and not speculation_valid(value):
        raise BadInput(f"setting speculate from {source}: {value!r} is not {', '.join(SPECULATE)}")
    if key == "draft_tokens" and not 0 <= value <= MAX_DRAFT:
        raise BadInput(f"setting draft_tokens from {source}: {value} is not 1 to {MAX_DRAFT} (0: adaptive)")
    if key == "ranks" and value < 1:
        raise BadInput(f"setting ranks from {source}: must be at least 1")
    setattr(settings, key, value)
    settings.sources[key] = source


def resolve_settings(args: argparse.Namespace, config_file: Path | None = None) -> Settings:
    settings = Settings()
    settings.sources = {key: "default" for key in _CASTS}
    path = config_file or config_dir() / "config.toml"
    if path.exists():
        try:
            data = tomllib.loads(path.read_text(encoding="utf-8"))
        except (OSError, tomllib.TOMLDecodeError) as e:
            raise BadInput(f"cannot read config file {path}: {e}") from None
        for key, value in data.items():
            if key not in _CASTS:
                raise BadInput(f"unknown setting {key!r} in {path}")
            _set(settings, key, value, str(path))
    for key in _CASTS:
        env = os.environ.get(f"CPCHAT_{key.upper()}")
        if env is not None:
            _set(settings, key, env, f"CPCHAT_{key.upper()}")
    flags = {
        "model": args.model,
        "ranks": args.ranks,
        "algorithm": args.algorithm,
        "shares": args.shares,
        "stages": args.stages,
        "max_tokens": args.max_tokens,
        "temp": args.temp,
        "top_p": args.top_p,
        "seed": args.seed,
        "blas": args.blas,
        "threads": args.threads,
        "cache": False if args.no_cache else None,
        "cache_dir": args.cache_dir,
        "cache_max_gb": args.cache_max_gb,
        "kv_bits": args.kv_bits,
        "kv_group_size": args.kv_group_size,
        "quantized_kv_start": args.quantized_kv_start,
        "speculate": args.speculate,
        "draft_tokens": args.draft_tokens,
    }
    for key, value in flags.items():
        if value is not None:
            _set(settings, key, value, "flag --" + key.replace("_", "-"))
    return settings


def rank_flags(settings: Settings) -> list[str]:
    """The prefix-cache settings as flags for the local ranks a front end launches."""
    if not settings.cache:
        return ["--no-cache"]
    flags = ["--cache-max-gb", str(settings.cache_max_gb)]
    return flags + (["--cache-dir", str(Path(settings.cache_dir).expanduser())] if settings.cache_dir else [])


def demo_model() -> tuple[Path, str]:
    """The built-in demo model and a plain description of it."""
    trained = bundled("demo-model")
    if (trained / "config.json").exists():
        card = trained / "README.md"
        return trained, f"the built-in demo model, {model_card_summary(trained)} (model card: {card})"
    from cpchat.smallmodels import write_model

    path = cache_dir() / "random-demo-model"
    if not (path / "model.safetensors").exists():
        write_model(path, "llama", hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=2)
    return path, "a random-weights llama (no trained demo model is installed): it shows the machinery only"


def model_card_summary(model: Path) -> str:
    """The first sentence of a model card's first paragraph, lower-cased to follow a comma: the one
    description of the demo model, so that it cannot go stale."""
    card = (model / "README.md").read_text(encoding="utf-8") if (model / "README.md").exists() else ""
    paragraphs = [p for p in card.split("\n\n") if p.strip() and not p.startswith("#")]
    if not paragraphs:
        return "a small model"
    sentence = " ".join(paragraphs[0].split()).split(". ")[0].rstrip(".")
    return sentence[:1].lower() + sentence[1:]


def resolve_model(model: str) -> tuple[str, str]:
    """What the ranks load (an absolute directory, a hub id or a checkpoint they resolve themselves)
    and a description; touches no network."""
    if not model:
        path, description = demo_model()
        return str(path), description
    if is_checkpoint(model):
        return checkpoint_spec(model)
    path = Path(model).expanduser()
    if path.exists():
        if not (path / "config.json").exists():
            raise BadInput(f"{model} is not an mlx-lm model directory (no config.json)")
        return str(path.resolve()), str(path)
    if is_hub_id(model):
        return model, f"hub model {model}"
    raise BadInput(f"model path {model} does not exist")


def checkpoint_spec(model: str) -> tuple[str, str]:
    """A GGUF file (absolute, its header checked here: a bad file is refused before any rank starts),
    an Ollama model or a named one, as the ranks are to be given it."""
    from cpchat.checkpoints.gguf_file import read_gguf

    if model in NAMED:
        return model, NAMED[model].about
    try:
        path = local_gguf(model)
        read_gguf(path).close()
    except CheckpointError as e:
        raise BadInput(str(e)) from None
    if is_ollama(model):
        return model, f"Ollama model {model.removeprefix('ollama:')}"
    return str(path.resolve()), str(path)


def format_config(settings: Settings) -> str:
    """Every setting, its value, and where the value came from (`cpchat --print-config`)."""
    names = [f.name for f in fields(Settings) if f.name != "sources"]
    width = max(len(n) for n in names)
    lines = [f"# config file: {config_dir() / 'config.toml'}", f"# transcripts: {data_dir() / 'transcripts'}"]
    for name in names:
        value = getattr(settings, name)
        shown = repr(value) if isinstance(value, str) else ("none" if value is None else str(value))
        if name == "model" and not value:
            shown = "'' (the built-in demo model)"
        lines.append(f"{name:<{width}} = {shown:<32} # {settings.sources.get(name, 'default')}")
    return "\n".join(lines)
