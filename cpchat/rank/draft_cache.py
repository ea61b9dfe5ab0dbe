"""A draft model's K/V in the prefix cache (cpchat/rank/prefix_cache.py), so that a conversation taken
from disk is not read again by its draft.

mlx-lm's cache objects are flattened as its own save_prompt_cache flattens them: the arrays of their
states (bfloat16 as its bits), their other fields and class names in the header. The file is one whole
shard (shard 0 of 1) of a model key of its own, the draft's files and settings: the answer model's
lookups never match it, even where a model is its own draft. A state that cannot be cut back (a linear
layer's, a window that wrapped) loads only at its whole length, as a ring's saved state does."""

from __future__ import annotations

import time
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

from cpchat.rank.prefix_cache import Found, Layout, model_identity, prefix_id
from cpchat.rank.prefix_shard import as_bits, from_bits


def draft_identity(path: Path) -> str:
    return model_identity(path, {"device": str(mx.default_device()), "draft": True})


def capture(cache: list, tokens: np.ndarray, identity: str, name: str) -> tuple[dict, dict]:
    """A draft's cache that holds `tokens`, as a prefix file's header and arrays (evaluated here)."""
    from mlx_lm.models.cache import can_trim_prompt_cache

    arrays: dict = {"tokens": tokens.astype(np.uint32)}
    dtypes, fields = {}, {}
    for key, x in tree_flatten([c.state for c in cache]):
        if isinstance(x, mx.array):
            arrays[key], dtypes[key] = as_bits(x)
        else:
            fields[key] = x  # offsets, sizes, None
    mx.eval([a for a in arrays.values() if isinstance(a, mx.array)])
    n = len(tokens)
    whole = [] if can_trim_prompt_cache(cache) else [n]
    return {"prefix_id": prefix_id(identity, Layout(1, ((0, n),)), tokens), "model_key": identity,
            "model": f"{name} (draft)", "num_ranks": 1, "shard": 0, "tokens": n, "segments": [[0, n]],
            "floor": n if whole else 0, "state_positions": whole, "dtypes": dtypes, "quantized": False,
            "classes": [type(c).__name__ for c in cache], "fields": fields, "saved": time.time()}, arrays


def restore(header: dict, arrays: dict[str, np.ndarray]) -> list:
    """The cache objects a file holds; KeyError, ValueError or AttributeError for a file that does not fit."""
    import mlx_lm.models.cache as caches

    leaves = [(k, from_bits(header, k, arrays[k])) for k in header["dtypes"]] + list(header["fields"].items())
    states = tree_unflatten(leaves)
    if len(states) != len(header["classes"]):
        raise ValueError(f"{len(states)} states for {len(header['classes'])} caches")
    return [getattr(caches, c).from_state(s) for c, s in zip(header["classes"], states, strict=True)]


def usable(found: Found) -> int:
    """How many of the request's tokens a saved draft state can give."""
    if found.state_positions:
        return found.tokens if found.common == found.tokens else 0
    return found.common
