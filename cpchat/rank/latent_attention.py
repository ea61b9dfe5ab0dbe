"""Multi-head latent attention (MLA: DeepSeek-V3, Kimi) through the ring.

mlx-lm's MLA layers cache a compressed latent c and a RoPE key k_pe per token, and hand attention
their RoPE scores as a mask computed from this rank's keys only, so the ring cannot use them as they
are. In the absorbed form every score and value comes from (c, k_pe) alone:

    score = scale * (q_nope . W_k c + q_pe . k_pe) = scale * [W_k^T q_nope, q_pe] . [c, k_pe]
    out   = W_v (sum_j p_j c_j)

so a layer is ordinary attention with one shared key head [c, k_pe] and value head c: the ring moves
the compact latent blocks and merges partials exactly like any other layer (mlx-lm decodes this way;
its prefill multiplies W_k and W_v into every key first, the same sums in another order).
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from cpchat.rank.context_parallel import ShardCache
from cpchat.rank.fit import mix_in

_PARTS = ("kv_a_proj_with_mqa", "kv_a_layernorm", "embed_q", "unembed_out", "rope", "o_proj")


class LatentAttention:
    """Mixed into an mlx-lm MLA attention class: the ring path for a ShardCache, the model's own
    code for any other cache."""

    def __call__(self, x: mx.array, mask: mx.array | None = None, cache=None) -> mx.array:
        if not isinstance(cache, ShardCache):
            return super().__call__(x, mask, cache)
        B, L, _ = x.shape
        if self.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.reshape(B, L, self.num_heads, self.q_head_dim).transpose(0, 2, 1, 3)
        q_nope, q_pe = mx.split(q, [self.qk_nope_head_dim], axis=-1)
        latent, k_pe = mx.split(self.kv_a_proj_with_mqa(x), [self.kv_lora_rank], axis=-1)
        k_pe = k_pe.reshape(B, L, 1, self.qk_rope_head_dim).transpose(0, 2, 1, 3)
        latent = mx.expand_dims(self.kv_a_layernorm(latent), axis=1)
        q_pe, k_pe = self.rope(q_pe, cache.offset), self.rope(k_pe, cache.offset)
        queries = mx.concatenate([self.embed_q(q_nope), q_pe], axis=-1)
        cache.update_and_fetch(mx.concatenate([latent, k_pe], axis=-1), latent)
        out = cache.ring_pass.attend(cache.layer, queries, latent, self.scale, None, None)
        out = self.unembed_out(out)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))


def is_latent(module: nn.Module) -> bool:
    return all(hasattr(module, part) for part in _PARTS) and hasattr(module, "kv_lora_rank")


def adapt(model: nn.Module) -> int:
    """Route every MLA layer of the model through the ring; how many there are."""
    latent = [module for _, module in model.named_modules() if is_latent(module)]
    for module in latent:
        mix_in(module, LatentAttention)
    return len(latent)
