"""`cpchat plan --paper HOSTS`: a model's shapes read here, without its weights (from the safetensors
headers where the files are here, else from mlx-lm's model built lazily from config.json: no weight
is allocated), planned over hosts given by their memory (cpchat.core.paper_plan)."""

from __future__ import annotations

import json
from pathlib import Path

from cpchat.client.models import parts_by_name, weight_parts
from cpchat.core.paper_plan import PAPER_SHARE, LayerKV, PaperModel, PaperPlan
from cpchat.core.quantized_kv import KVFormat
from cpchat.errors import BadInput
from cpchat.format import human_bytes, parse_size

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


def parse_hosts(text: str) -> list[int]:
    """'8x64G' (eight hosts of 64 GiB) or '64G,64G,32G' -> each host's memory in bytes."""
    try:
        count, _, size = text.partition("x") if "x" in text else ("1", "", "")
        sizes = [parse_size(size)] * int(count) if size else [parse_size(part) for part in text.split(",")]
    except ValueError:
        raise BadInput(f"--paper {text!r}: expected COUNTxSIZE (8x64G) or sizes (64G,64G,32G)") from None
    if not sizes or min(sizes) <= 0:
        raise BadInput(f"--paper {text!r}: expected at least one host with memory")
    return sizes


def paper_model(directory: Path, kv_format: KVFormat) -> PaperModel:
    """The model's weights by part and each layer's K/V a token, as its ranks would hold them."""
    import mlx.core as mx
    import mlx.nn as nn
    from mlx.utils import tree_flatten
    from mlx_lm.models.cache import KVCache, RotatingKVCache
    from mlx_lm.utils import _get_classes

    try:
        config = json.loads((directory / "config.json").read_text(encoding="utf-8"))
        model_class, args_class = _get_classes(config)
    except (OSError, ValueError) as e:
        raise BadInput(f"{directory}: cannot read the model's config.json: {e}") from None
    args = args_class.from_dict(config)
    model = model_class(args)  # lazy: its arrays are never evaluated
    # Hub configs name their dtype; without one, what mlx_lm.convert makes: bfloat16 beside 4-bit weights.
    guess = "bfloat16" if "quantization" in config else "float32"
    dtype = config.get("torch_dtype") or config.get("dtype") or guess
    element = DTYPE_BYTES.get(dtype, 4)
    model.set_dtype(getattr(mx, dtype if dtype in DTYPE_BYTES else "float32"))
    if quantization := config.get("quantization"):
        group = quantization["group_size"]
        nn.quantize(model, group, quantization["bits"], mode=quantization.get("mode", "affine"),
                    class_predicate=lambda path, m: quantization.get(
                        path, hasattr(m, "to_quantized") and m.weight.shape[-1] % group == 0))
    parts = weight_parts(directory)
    if not parts.layers:
        parts = parts_by_name((name, array.nbytes) for name, array in tree_flatten(model.parameters()))
    kv_heads = getattr(args, "num_key_value_heads", None) or args.num_attention_heads
    head_dim = getattr(args, "head_dim", None) or args.hidden_size // args.num_attention_heads
    held = kv_format.bytes_per_element(element) if kv_format.quantized else element
    per_token = 2 * kv_heads * head_dim * held
    caches = model.make_cache() if hasattr(model, "make_cache") else [KVCache() for _ in model.layers]
    kv = [LayerKV(per_token, c.max_size if isinstance(c, RotatingKVCache) else 0)
          if isinstance(c, KVCache | RotatingKVCache) else LayerKV(0) for c in caches]
    return PaperModel(parts, kv)


def paper_lines(plan: PaperPlan, model: str) -> list[str]:
    """The plan as `cpchat plan --paper` prints it: a line per host, then the verdict."""
    ring = len(plan.hosts) // plan.stages
    lines = [f"{model} on paper: {plan.context:,} tokens on {len(plan.hosts)} hosts, {plan.stages} "
             f"stage{'s' * (plan.stages > 1)} x {ring} context rank{'s' * (ring > 1)}, equal shares"]
    for i, h in enumerate(plan.hosts):
        first, end = h.layers
        lines.append(f"host {i}: stage {h.stage}, layers {first}-{end - 1}, {h.tokens:,} tokens, weights "
                     f"{human_bytes(h.weight_bytes)}, K/V {human_bytes(h.kv_bytes)}: "
                     f"{human_bytes(h.weight_bytes + h.kv_bytes)} of {human_bytes(h.memory_bytes)}")
    verdict = "holds on every host" if plan.holds else "does not hold on every host"
    lines.append(f"{verdict} (weights and K/V within {PAPER_SHARE:.0%} of a host's memory; the rest is for "
                 "activations, which ranks measure when they load)")
    return lines
