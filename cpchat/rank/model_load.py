"""Loading a model on a rank: mlx-lm loads it, ring attention is installed, and one probe forward finds
out what each layer's attention needs (ModelShape); what cpchat cannot serve is refused by name."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

from cpchat.checkpoints.resolve import is_checkpoint, model_dir
from cpchat.core.attention import one_query_kernel
from cpchat.core.quantized_kv import BITS, FULL_PRECISION, GROUP_SIZES, KVFormat
from cpchat.rank import context_parallel, fit, latent_attention, linear_layers, stages
from cpchat.rank.cpu_products import Products, use_cpu_products
from cpchat.rank.fit import Layer, LayerAttention, LayerElsewhere, LayerRecurrence, UnsupportedModel
from cpchat.rank.forward import probe_forward
from cpchat.rank.prefix_cache import model_identity
from cpchat.rank.stages import StagePlace


class KVFormatRefused(ValueError):
    """The model cannot keep its K/V in the format asked for; the message says why, by name."""


@dataclass
class ModelShape:
    """What this rank found in the model it loaded: head counts and sizes, and each layer's needs."""

    model_type: str
    num_layers: int  # layers with a cache: attention layers (KV) and linear layers (a recurrent state)
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    bytes_per_element: int  # of the K/V the ranks hold and send
    max_context: int
    layers: list[Layer]
    exact_tokens: int | None  # past this, mlx-lm's own RoPE depends on how it cuts the prompt
    latent: bool = False  # MLA layers: keys and values are a compressed latent
    kv_format: KVFormat = FULL_PRECISION
    identity: str = ""  # the model's files and the settings its K/V depend on (prefix_cache.model_identity)
    structure: str = ""  # its config and each weight's shape and dtype: what its speed depends on
    place: StagePlace = StagePlace()  # the layers this rank runs, as a pipeline stage
    products: Products = Products()  # how its low-precision layers multiply on the CPU

    @property
    def linear(self) -> frozenset[int]:
        """The layers that keep a recurrent state."""
        return frozenset(i for i, layer in enumerate(self.layers) if isinstance(layer, LayerRecurrence))

    @property
    def first_attention(self) -> LayerAttention:
        return next(layer for layer in self.layers if isinstance(layer, LayerAttention))

    @property
    def kv_bytes_per_token(self) -> int:
        """Keys and values one token takes in this rank's attention layers, at full precision."""
        return sum(layer.key_heads * (layer.key_dim + layer.value_dim) * layer.dtype_bytes
                   for layer in self.layers if isinstance(layer, LayerAttention))

    @property
    def attention_layers(self) -> int:
        """Layers this rank keeps keys and values for."""
        return sum(isinstance(layer, LayerAttention) for layer in self.layers)

    @property
    def elsewhere(self) -> frozenset[int]:
        return frozenset(i for i, layer in enumerate(self.layers) if isinstance(layer, LayerElsewhere))


def load_model(name: str, kv_format: KVFormat = FULL_PRECISION,
               place: Callable[[int], StagePlace] | None = None, free_bytes: int = 0):
    """Load with mlx-lm (a directory, a hub id `ORG/NAME[@revision]` or a checkpoint to convert, each
    resolved on this machine) the layers `place` gives this rank of the model's, reading no other
    weights, and only if they fit the `free_bytes` it may hold (0: unchecked); install ring attention,
    and find out what each layer's attention needs."""
    from mlx_lm.utils import load_model as mlx_lm_load_model

    local = local_model(name)
    try:
        model, config = mlx_lm_load_model(local, lazy=True)
    except ValueError as e:
        if "not supported" in str(e):
            raise UnsupportedModel(str(e)) from None
        raise
    stage = (place or stages.one_stage)(len(model.layers))
    if free_bytes:
        stages.check_weights_fit(stages.weight_parts(model), stage, free_bytes,
                                 config.get("model_type", fit.model_name(model)))
    stages.keep_stage(model, stage)
    mx.eval(model.parameters())
    context_parallel.install()
    linear_layers.install()
    latent = latent_attention.adapt(model) > 0
    linear_layers.adapt(model)
    max_positions = int(config.get("max_position_embeddings") or 0)
    exact_tokens = fit.fit_rotary(model, max_positions)
    usable = fit.usable_context(config)
    products = use_cpu_products(model) if mx.default_device() == mx.cpu else Products()
    vocab_size = _vocab_size(model, config)
    layers = fit.describe_layers(model, probe_forward(model, vocab_size), range(stage.first, stage.end))
    first = next((layer for layer in layers if isinstance(layer, LayerAttention)), None)
    if first is None:  # cache_slots saw one in the model: it is another stage's
        name = config.get("model_type", fit.model_name(model))
        raise stages.StagesRefused(f"{name}: layers {stage.first}-{stage.end - 1} keep recurrent states "
                                   "only; every stage needs a layer that attends over keys and values: "
                                   "give --stages layer counts that do")
    if mx.default_device() == mx.cpu and first.dtype_bytes == 2:
        one_query_kernel()  # compiled (or read from numba's cache) now, not in the first decode step
    info = ModelShape(
        model_type=config.get("model_type", fit.model_name(model)),
        num_layers=len(layers),
        num_q_heads=first.query_heads,
        num_kv_heads=first.key_heads,
        head_dim=first.key_dim,
        vocab_size=vocab_size,
        bytes_per_element=first.dtype_bytes,
        max_context=min(filter(None, (usable, exact_tokens)), default=0),  # 0: the config does not say
        layers=layers,
        exact_tokens=exact_tokens,
        latent=latent,
        kv_format=kv_format,
        place=stage,
        products=products,
    )
    check_kv_format(info)
    settings = {"device": str(mx.default_device()), "kv_bytes": first.dtype_bytes,
                "kv_format": [kv_format.bits, kv_format.group_size, kv_format.start]}
    info.identity = model_identity(local, settings)
    info.structure = structure(config, model)
    return model, info


def local_model(name: str) -> Path:
    """The directory of an mlx-lm model on this machine: a GGUF file, an Ollama model or a named one
    converted here, a hub id `ORG/NAME[@revision]` downloaded (or found in the hub's cache)."""
    from mlx_lm.utils import _download

    if is_checkpoint(name):
        name = str(model_dir(name))
    path, revision = (name, None) if Path(name).exists() else _split_revision(name)
    return Path(_download(path, revision=revision))


def structure(config: dict, model) -> str:
    """A hash of what a model's speed depends on and its weights' values do not change."""
    digest = hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode())
    for name, array in tree_flatten(model.parameters()):
        digest.update(f"{name}\0{array.shape}\0{array.dtype}\0".encode())
    return digest.hexdigest()


def check_kv_format(info: ModelShape) -> None:
    """Refuse, by name, what mlx-lm itself cannot quantize (or MLX cannot group)."""
    fmt = info.kv_format
    if not fmt.quantized:
        return
    if fmt.bits not in BITS or fmt.group_size not in GROUP_SIZES:
        raise KVFormatRefused(f"--kv-bits {fmt.bits} --kv-group-size {fmt.group_size}: cpchat quantizes K/V "
                              f"to {' or '.join(map(str, BITS))} bits in groups of "
                              f"{', '.join(map(str, GROUP_SIZES))}")
    attention = [layer for layer in info.layers if isinstance(layer, LayerAttention)]
    name = info.model_type
    if any(layer.window for layer in attention):
        raise KVFormatRefused(f"--kv-bits: {name}'s sliding-window layers keep a rotating cache, which "
                              "mlx-lm cannot quantize (RotatingKVCache has no quantized form)")
    if any(layer.sinks for layer in attention):
        raise KVFormatRefused(f"--kv-bits: {name}'s attention sinks are not supported by mlx-lm's quantized "
                              "attention")
    if info.latent:
        raise KVFormatRefused(f"--kv-bits: {name}'s multi-head latent attention caches a compressed latent, "
                              "which mlx-lm does not quantize")
    dims = sorted({d for layer in attention for d in (layer.key_dim, layer.value_dim)})
    if any(d % fmt.group_size for d in dims):
        fits = [g for g in GROUP_SIZES if all(d % g == 0 for d in dims)]
        hint = f": try --kv-group-size {fits[-1]}" if fits else ""
        raise KVFormatRefused(f"--kv-group-size {fmt.group_size} does not divide {name}'s head size "
                              f"{'/'.join(map(str, dims))} (K/V are quantized in groups along it){hint}")


def _split_revision(name: str) -> tuple[str, str | None]:
    repo, _, revision = name.partition("@")
    return repo, revision or None


def _vocab_size(model, config: dict) -> int:
    vocab = config.get("vocab_size") or config.get("text_config", {}).get("vocab_size")
    return int(vocab or model.model.embed_tokens.weight.shape[0])
