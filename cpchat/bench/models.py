"""The models the bench runs: a random llama or hybrid of a given shape, or the checkpoint --model names,
either converted with mlx_lm.convert as checkpoints are published. Each is built once and cached, so
every run of a shape measures the same weights."""

from __future__ import annotations

from pathlib import Path

from cpchat.checkpoints.resolve import DownloadLines, is_checkpoint, model_dir
from cpchat.dirs import cache_dir

# Per linear layer, the head counts and sizes of released hybrids (Qwen3.5's Gated DeltaNet: 16 key and 32
# value heads of 128; Nemotron-H's Mamba-2: heads of 64 over a 128-wide state), at any --hidden.
ARCHS = {
    "llama": {},
    "qwen3_5": {"linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_key_head_dim": 128,
                "linear_value_head_dim": 128, "full_attention_interval": 4},
    "nemotron_h": {"mamba_num_heads": 32, "mamba_head_dim": 64, "ssm_state_size": 128, "n_groups": 8},
}


def random_model(hidden: int, layers: int, heads: int | None = None, kv_heads: int | None = None,
                 arch: str = "llama") -> Path:
    """A random float32 model of `arch` (cached); a quarter as many KV heads as query heads unless told.
    A hybrid's layers come in fours, three linear and one full attention (nemotron_h: M M M *)."""
    from cpchat.smallmodels import write_model

    heads = heads or max(4, hidden // 64)
    kv_heads = kv_heads or max(1, heads // 4)
    if heads % kv_heads:
        raise ValueError(f"{heads} query heads cannot share {kv_heads} KV heads evenly")
    name = f"bench-{arch}-h{hidden}-l{layers}-a{heads}-kv{kv_heads}"
    path = cache_dir() / name
    overrides = dict(ARCHS[arch])
    if arch == "nemotron_h":
        overrides["hybrid_override_pattern"] = [("*" if i % 4 == 3 else "M") for i in range(layers)]
    if not (path / "config.json").exists():
        write_model(
            path,
            arch,
            hidden_size=hidden,
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=kv_heads,
            intermediate_size=hidden * 3,
            overrides=overrides,
        )
    return path


def source_model(name: str | None, hidden: int, layers: int, heads: int | None, kv_heads: int | None,
                 arch: str) -> Path:
    """--model as a directory (a GGUF file, ollama:NAME or a named model such as smollm2 resolved to one,
    fetched if need be), or a random model of the given shape when there is none. Raises
    CheckpointError for a checkpoint that cannot be had."""
    if name and is_checkpoint(name):
        return model_dir(name, report=DownloadLines())
    return Path(name) if name else random_model(hidden, layers, heads, kv_heads, arch)


def in_form(model: Path, form: str) -> Path:
    """`model` converted with mlx_lm.convert into `form` (cached), as checkpoints are published."""
    from cpchat.smallmodels import convert_model

    if form == "float32":
        return model
    converted = cache_dir() / f"{model.resolve().name}-{form}"
    if not (converted / "config.json").exists():
        convert_model(model, converted, form)
    return converted
