"""A draft model for speculative decoding (--speculate draft:MODEL, as mlx-lm's --draft-model): a small
model of the answer model's tokenizer, whole on the sampling rank, whose greedy continuation of the
conversation proposes the next tokens. Its own K/V follow the conversation: each call keeps what the
tokens share with those it read last and reads the rest, so a rejected proposal costs a cut, not a
re-read, and a new turn reads only its new tokens. They are saved with the ring's prefix and taken
back from it (cpchat.rank.draft_cache): a conversation loaded from disk is not read again."""

from __future__ import annotations

import sys

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from cpchat.format import human_bytes
from cpchat.rank import draft_cache
from cpchat.rank.cpu_products import keep_float32_weights, use_cpu_products
from cpchat.rank.model_load import local_model
from cpchat.rank.prefix_cache import CacheMiss, Entry, shared_length
from cpchat.rank.prefix_keeper import PrefixKeeper

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
            path = local_model(name)
            self.model, _ = load_model(path, lazy=True)
        except (OSError, ValueError, KeyError) as e:
            raise DraftModelError(f"draft model {name}: {e}") from None
        self.weight_bytes = sum(a.nbytes for _, a in tree_flatten(self.model.parameters()))
        if free is not None and self.weight_bytes > free:
            raise DraftModelError(f"draft model {name}: its weights take {human_bytes(self.weight_bytes)} "
                                  f"but this rank may hold {human_bytes(free)} more")
        mx.eval(self.model.parameters())
        if mx.default_device() == mx.cpu and use_cpu_products(self.model).float32:
            mx.eval(self.model(mx.array([[0]])))  # marks a tied embedding as the output head
            keep_float32_weights(self.model, copy_budget)
        self.token_bytes = self._token_bytes()
        self.cache = self._empty_cache()
        self.read = np.zeros(0, np.uint32)  # the tokens its cache holds
        self.identity = draft_cache.draft_identity(path)
        self.origin: Entry | None = None  # the saved file its cache continues, which the next save supersedes

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
        shared = self._cut(tokens, len(tokens) - 1)
        for a in range(shared, len(tokens) - 1, READ_CHUNK):
            self.model(mx.array(tokens[None, a:min(a + READ_CHUNK, len(tokens) - 1)]), cache=self.cache)
            mx.eval([c.state for c in self.cache])
        return self.model(mx.array(tokens[None, -1:]), cache=self.cache)

    def _cut(self, tokens: np.ndarray, most: int) -> int:
        """Cut the cache back to what it shares with `tokens`, `most` at most; returns how many it holds."""
        from mlx_lm.models.cache import can_trim_prompt_cache, trim_prompt_cache

        shared = self._shared(tokens, most)
        if shared < len(self.read):
            if can_trim_prompt_cache(self.cache):
                trim_prompt_cache(self.cache, len(self.read) - shared)
            else:  # a state that cannot be cut back (a linear layer, a window that wrapped): read again
                self.cache, shared = self._empty_cache(), 0
        self.read = self.read[:shared]
        if self.origin is not None and self.origin.header["tokens"] > shared:
            self.origin = None
        return shared

    def _shared(self, tokens: np.ndarray, most: int) -> int:
        return shared_length(self.read[:most], tokens)

    def resume(self, keeper: PrefixKeeper, tokens: np.ndarray) -> None:
        """Take the saved state that gives most of the conversation `tokens`, if it gives more than the
        cache holds now."""
        if keeper.cache is None:
            return
        keeper.flush()
        held = self._cut(tokens, len(tokens))
        found = max(keeper.cache.find(self.identity, tokens), key=draft_cache.usable, default=None)
        if found is None or draft_cache.usable(found) <= held:
            return
        try:
            header, arrays = keeper.cache.load(found.prefix_id, 0, 1, self.identity)
            cache = draft_cache.restore(header, arrays)
        except CacheMiss:
            return
        except (KeyError, ValueError, TypeError, AttributeError) as e:  # a whole file that does not fit
            keeper.cache.discard(keeper.cache.path(found.prefix_id, 0, 1))
            print(f"cpchat rank: removed a saved draft state that does not fit {self.name}: {e}",
                  file=sys.stderr, flush=True)
            return
        self.cache, self.read = cache, arrays["tokens"].copy()
        self.origin = Entry(keeper.cache.path(found.prefix_id, 0, 1), header)
        self._cut(tokens, draft_cache.usable(found))

    def save(self, keeper: PrefixKeeper) -> None:
        """Save the cache, cut to what it shares with the ring's tokens, beside the ring's prefix; it
        supersedes the file it continues where it can be cut anywhere (as that one could)."""
        from mlx_lm.models.cache import can_trim_prompt_cache

        tokens = keeper.tokens
        if keeper.cache is None or (self._shared(tokens, len(tokens)) < len(self.read)
                                    and not can_trim_prompt_cache(self.cache)):
            return  # (a state that holds tokens past the ring's and cannot be cut back is not saved)
        if self._cut(tokens, len(tokens)) == 0:
            return
        header, arrays = draft_cache.capture(self.cache, self.read, self.identity, self.name)
        replaces = self.origin if self.origin is not None and not header["state_positions"] else None
        self.origin = Entry(keeper.cache.path(header["prefix_id"], 0, 1), header)
        keeper.write(header, arrays, replaces)

    def _empty_cache(self) -> list:
        from mlx_lm.models.cache import make_prompt_cache

        return make_prompt_cache(self.model)
