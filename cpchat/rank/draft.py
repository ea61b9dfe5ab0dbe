"""A draft model for speculative decoding (--speculate draft:MODEL, as mlx-lm's --draft-model): a small
model of the answer model's tokenizer, whole on the sampling rank, whose greedy continuation of the
conversation proposes the next tokens. Its own K/V follow the conversation: each call keeps what the
tokens share with those it read last and reads the rest, so a rejected proposal costs a cut, not a
re-read, and a new turn reads only its new tokens."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from cpchat.format import human_bytes
from cpchat.rank.cpu_products import keep_float32_weights, use_float32_products
from cpchat.rank.model_load import local_model

READ_CHUNK = 512  # tokens a forward call reads while catching up with the conversation
GROWTH = 256  # tokens by which mlx-lm's caches grow their buffers
DRAFT_TOKENS = 3  # proposals a step unless --draft-tokens says (mlx-lm's --num-draft-tokens)


class DraftModelError(ValueError):
    """The draft model could not be loaded, or does not fit; the message names it."""


class DraftModel:
    """On the CPU its low-precision weights multiply in float32, from float32 copies where they fit
    `copy_budget` bytes (cpchat.rank.cpu_products): a draft's steps are one token each. Weights that
    take more than the `free` bytes this rank may still hold (None: unchecked) are refused before any
    is read."""

    def __init__(self, name: str, copy_budget: int = 0, free: int | None = None) -> None:
        from mlx_lm.utils import load_model

        self.name = name
        try:
            self.model, _ = load_model(local_model(name), lazy=True)
        except (OSError, ValueError, KeyError) as e:
            raise DraftModelError(f"draft model {name}: {e}") from None
        weights = sum(a.nbytes for _, a in tree_flatten(self.model.parameters()))
        if free is not None and weights > free:
            raise DraftModelError(f"draft model {name}: its weights take {human_bytes(weights)} but this "
                                  f"rank may hold {human_bytes(free)} more")
        mx.eval(self.model.parameters())
        if mx.default_device() == mx.cpu and use_float32_products(self.model):
            mx.eval(self.model(mx.array([[0]])))  # marks a tied embedding as the output head
            keep_float32_weights(self.model, copy_budget)
        self.token_bytes = self._token_bytes()
        self.cache = self._empty_cache()
        self.read = np.zeros(0, np.uint32)  # the tokens its cache holds

    def check_room(self, tokens: int, free: int) -> None:
        """Refuse a conversation of `tokens` whose K/V the draft could not hold in `free` bytes more."""
        need = max(tokens - len(self.read), 0) * self.token_bytes
        if need > free:
            raise DraftModelError(f"draft model {self.name}: its K/V of {tokens:,} tokens take "
                                  f"{human_bytes(need)} more but this rank may hold {human_bytes(free)} more")

    def _token_bytes(self) -> int:
        """What a token adds to the draft's cache, whatever its layers hold: the state after 257 tokens
        less the state after one, a token's share (caches grow in steps of 256 tokens; a fixed-size
        state, a linear layer's, adds nothing; a sliding window's adds until it is full)."""
        held = []
        for n in (1, 1 + GROWTH):
            cache = self._empty_cache()
            self.model(mx.zeros((1, n), mx.uint32), cache=cache)
            arrays = [a for c in cache for _, a in tree_flatten(c.state) if isinstance(a, mx.array)]
            held.append(sum(a.nbytes for a in arrays))
        return (held[1] - held[0]) // GROWTH

    def propose(self, tokens: np.ndarray, k: int) -> list[int]:
        """The draft's `k` most likely next tokens after `tokens`, one at a time (greedy)."""
        logits = self._follow(tokens)
        proposed: list[int] = []
        while True:
            proposed.append(int(mx.argmax(logits[0, -1]).item()))
            if len(proposed) == k:
                break
            logits = self.model(mx.array([proposed[-1:]]), cache=self.cache)
        self.read = np.append(tokens, np.array(proposed[:-1], np.uint32))
        return proposed

    def _follow(self, tokens: np.ndarray) -> mx.array:
        """Cut the cache back to what it shares with `tokens` (one token short of them at most, to have
        logits to read) and read the rest: the K/V of all but the last token (the output head's
        product is never evaluated for them, as in mlx-lm's prefill), then the last token's logits."""
        from mlx_lm.models.cache import can_trim_prompt_cache, trim_prompt_cache

        m = min(len(self.read), len(tokens) - 1)
        differ = np.flatnonzero(self.read[:m] != tokens[:m])
        shared = int(differ[0]) if len(differ) else m
        if shared < len(self.read):
            if can_trim_prompt_cache(self.cache):
                trim_prompt_cache(self.cache, len(self.read) - shared)
            else:  # a state that cannot be cut back (a linear layer, a window that wrapped): read again
                self.cache, shared = self._empty_cache(), 0
        for a in range(shared, len(tokens) - 1, READ_CHUNK):
            self.model(mx.array(tokens[None, a:min(a + READ_CHUNK, len(tokens) - 1)]), cache=self.cache)
            mx.eval([c.state for c in self.cache])
        return self.model(mx.array(tokens[None, -1:]), cache=self.cache)

    def _empty_cache(self) -> list:
        from mlx_lm.models.cache import make_prompt_cache

        return make_prompt_cache(self.model)
