"""The llama the demo model is trained as, in PyTorch, with mlx-lm's parameter names and layout (so the
trained weights load into mlx-lm as they are)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, d: int, eps: float = 1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class Attention(nn.Module):
    def __init__(self, d: int, nh: int, nkv: int):
        super().__init__()
        self.nh, self.nkv, self.hd = nh, nkv, d // nh
        self.q_proj = nn.Linear(d, nh * self.hd, bias=False)
        self.k_proj = nn.Linear(d, nkv * self.hd, bias=False)
        self.v_proj = nn.Linear(d, nkv * self.hd, bias=False)
        self.o_proj = nn.Linear(nh * self.hd, d, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, temp: float) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.nh, self.hd).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.nkv, self.hd).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.nkv, self.hd).transpose(1, 2)
        q, k = rope(q, cos, sin), rope(k, cos, sin)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=temp / math.sqrt(self.hd),
                                           enable_gqa=self.nkv != self.nh)
        return self.o_proj(o.transpose(1, 2).reshape(b, t, -1))


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Non-traditional (half-split) rotary embedding, as mlx's nn.RoPE(traditional=False)."""
    h = x.shape[-1] // 2
    x1, x2 = x[..., :h], x[..., h:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class MLP(nn.Module):
    def __init__(self, d: int, ff: int):
        super().__init__()
        self.gate_proj = nn.Linear(d, ff, bias=False)
        self.up_proj = nn.Linear(d, ff, bias=False)
        self.down_proj = nn.Linear(ff, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    def __init__(self, d: int, nh: int, nkv: int, ff: int):
        super().__init__()
        self.self_attn = Attention(d, nh, nkv)
        self.mlp = MLP(d, ff)
        self.input_layernorm = RMSNorm(d)
        self.post_attention_layernorm = RMSNorm(d)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, temp: float) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, temp)
        return x + self.mlp(self.post_attention_layernorm(x))


class Inner(nn.Module):
    def __init__(self, cfg: dict):
        super().__init__()
        d = cfg["hidden_size"]
        self.embed_tokens = nn.Embedding(cfg["vocab_size"], d)
        self.layers = nn.ModuleList(
            Layer(d, cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["intermediate_size"])
            for _ in range(cfg["num_hidden_layers"])
        )
        self.norm = RMSNorm(d)


class Llama(nn.Module):
    """Parameter names match mlx-lm's llama, so the state dict saves as-is."""

    def __init__(self, cfg: dict):
        super().__init__()
        self.cfg = cfg
        self.model = Inner(cfg)
        self.tied = cfg["tie_word_embeddings"]
        if not self.tied:
            self.lm_head = nn.Linear(cfg["hidden_size"], cfg["vocab_size"], bias=False)
        hd = cfg["head_dim"]
        inv = cfg["rope_theta"] ** (-torch.arange(0, hd, 2, dtype=torch.float64) / hd)
        self.register_buffer("inv_freq", inv, persistent=False)
        for name, p in self.named_parameters():
            if p.dim() == 2:
                residual_out = name.endswith(("o_proj.weight", "down_proj.weight"))
                std = 0.02 / math.sqrt(2 * cfg["num_hidden_layers"]) if residual_out else 0.02
                nn.init.normal_(p, std=std)

    def forward(self, ids: torch.Tensor, pos: torch.Tensor, temp: float = 1.0) -> torch.Tensor:
        """`temp` scales every attention logit (1.0: the model as mlx-lm runs it)."""
        ang = (pos.to(torch.float64)[..., None] * self.inv_freq).float()[:, None]  # B,1,T,hd/2
        cos, sin = ang.cos(), ang.sin()
        x = self.model.embed_tokens(ids)
        for layer in self.model.layers:
            x = layer(x, cos, sin, temp)
        x = self.model.norm(x)
        return x @ self.model.embed_tokens.weight.T if self.tied else self.lm_head(x)


def deepened(weights: dict[str, torch.Tensor], model: Llama) -> dict[str, torch.Tensor]:
    """`weights` of a shallower model spread over `model`'s layers, the new layers in between starting
    as identities (their residual outputs zero), so the deeper model first computes what the old one did."""
    old = 1 + max(int(k.split(".")[2]) for k in weights if k.startswith("model.layers."))
    new = len(model.model.layers)
    if new == old:
        return weights
    slot = {round(i * new / old): i for i in range(old)}  # new layer index -> old layer index
    out = {k: v for k, v in weights.items() if not k.startswith("model.layers.")}
    for k, v in model.state_dict().items():
        if k.startswith("model.layers."):
            j, rest = int(k.split(".")[2]), k.split(".", 3)[3]
            if j in slot:
                out[k] = weights[f"model.layers.{slot[j]}.{rest}"]
            else:
                out[k] = torch.zeros_like(v) if rest.endswith(("o_proj.weight", "down_proj.weight")) else v
    return out
