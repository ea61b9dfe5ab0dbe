"""`cpchat --list-architectures`: what cpchat makes of each model family, found out by loading a
tiny random model of the family and running the same check a rank runs at load (`fit`)."""

from __future__ import annotations

import contextlib
import io
import tempfile
from pathlib import Path

from cpchat.rank.fit import UnsupportedModel


def describe(arch: str, root: Path) -> str:
    from cpchat.rank.model_load import load_model
    from cpchat.smallmodels import write_model

    path = write_model(root / arch, arch)
    try:
        _, info = load_model(str(path))
    except UnsupportedModel as e:
        return f"refused: {str(e).split(': ', 1)[-1]}"
    from cpchat.rank.fit import LayerAttention

    layers = [layer for layer in info.layers if isinstance(layer, LayerAttention)]
    traits = [f"{layers[0].query_heads}:{layers[0].key_heads} heads"]
    if info.linear:
        kinds = ", ".join(sorted({info.layers[i].recurrence for i in info.linear}))
        traits.append(f"{len(info.linear)} of {len(info.layers)} layers linear ({kinds})")
    windows = sorted({layer.window for layer in layers if layer.window})
    if windows:
        sliding = sum(1 for layer in layers if layer.window)
        traits.append(f"sliding window {', '.join(map(str, windows))} on {sliding} of {len(layers)} layers")
    if any(layer.sinks for layer in layers):
        traits.append("attention sinks")
    if any(layer.value_dim != layer.key_dim for layer in layers):
        traits.append("value size differs from key size")
    if info.exact_tokens:
        traits.append(f"up to {info.exact_tokens} tokens (its RoPE scales with the sequence length)")
    return "works: " + ", ".join(traits)


def print_architectures() -> int:
    from cpchat.families import ARCHITECTURES

    print("Model types checked here (a tiny random model of each, through the check every rank runs;")
    print("the test suite compares each with mlx-lm's own generation through 2 and 3 ranks):\n")
    with tempfile.TemporaryDirectory() as tmp, contextlib.redirect_stderr(io.StringIO()):
        rows = [(arch, describe(arch, Path(tmp))) for arch in ARCHITECTURES]
    width = max(len(arch) for arch, _ in rows)
    for arch, verdict in rows:
        print(f"  {arch:<{width}}  {verdict}")
    print("\nAny other mlx-lm model is checked the same way when it loads: one whose attention is")
    print("softmax attention through mlx-lm's scaled_dot_product_attention runs, and so does a")
    print("hybrid whose linear layers run mlx-lm's gated_delta_update or ssm_update; anything else")
    print("is refused, saying why.")
    print("Forms: float32, bfloat16, float16, and 4/8-bit quantized (mlx_lm.convert -q).")
    return 0
