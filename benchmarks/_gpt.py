"""A small decoder-only transformer (GPT) for the real-loop benchmark, written for this project.

Token and position embeddings, `layers` pre-LayerNorm blocks (causal self-attention through
`F.scaled_dot_product_attention`, then a 4x MLP with GELU), a final LayerNorm and a language
model head whose weight is the token embedding's (`tied=True`) or its own.

`GPT(cfg)(idx, targets)` returns `(logits, loss)`; `loss` is None without targets. Two sizes
are named here: `GPT2_SMALL` (124M parameters, the CUDA configuration) and `CPU_TINY` (small
enough for a CI smoke test on one CPU thread).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

__all__ = ["CPU_TINY", "GPT", "GPT2_SMALL", "GPTConfig", "random_batches"]


@dataclass(frozen=True)
class GPTConfig:
    """Shape of the model; `block` is the longest sequence (context length)."""

    vocab: int = 50304
    block: int = 1024
    layers: int = 12
    heads: int = 12
    dim: int = 768
    tied: bool = True
    bias: bool = True

    def __post_init__(self) -> None:
        if self.dim % self.heads:
            raise ValueError(f"dim ({self.dim}) must be a multiple of heads ({self.heads})")


GPT2_SMALL = GPTConfig()
"""GPT-2 124M shapes (vocab padded to 50304, a multiple of 64)."""

CPU_TINY = GPTConfig(vocab=512, block=64, layers=2, heads=4, dim=128)
"""~15 ms a step at batch 4 x 64 with AdamW on one CPU thread (a 2-core AMD EPYC VM)."""


class CausalSelfAttention(nn.Module):
    """Multi-head attention where each position sees itself and the positions before it."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.heads = cfg.heads
        self.qkv = nn.Linear(cfg.dim, 3 * cfg.dim, bias=cfg.bias)
        self.out = nn.Linear(cfg.dim, cfg.dim, bias=cfg.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        h = self.heads
        # (b, t, 3d) -> three (b, h, t, d/h)
        q, k, v = self.qkv(x).view(b, t, 3, h, d // h).permute(2, 0, 3, 1, 4).unbind(0)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = y.transpose(1, 2).reshape(b, t, d)
        out: torch.Tensor = self.out(y)
        return out


class FeedForward(nn.Module):
    """dim -> 4 dim -> GELU -> dim."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.up = nn.Linear(cfg.dim, 4 * cfg.dim, bias=cfg.bias)
        self.act = nn.GELU()
        self.down = nn.Linear(4 * cfg.dim, cfg.dim, bias=cfg.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.down(self.act(self.up(x)))
        return out


class Block(nn.Module):
    """x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(cfg.dim, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.norm2 = nn.LayerNorm(cfg.dim, bias=cfg.bias)
        self.mlp = FeedForward(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        out: torch.Tensor = x + self.mlp(self.norm2(x))
        return out


class GPT(nn.Module):
    """The whole model; see the module docstring."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab, cfg.dim)
        self.pos = nn.Embedding(cfg.block, cfg.dim)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.norm = nn.LayerNorm(cfg.dim, bias=cfg.bias)
        self.head = nn.Linear(cfg.dim, cfg.vocab, bias=False)
        if cfg.tied:
            self.head.weight = self.tok.weight
        self._init_weights()

    def _init_weights(self) -> None:
        # Normal(0, 0.02) everywhere; the projections back into the residual stream are
        # scaled down by sqrt(2 * layers) so the stream's variance does not grow with depth.
        residual_std = 0.02 / math.sqrt(2 * self.cfg.layers)
        for name, p in self.named_parameters():
            if p.dim() < 2:  # biases and LayerNorm weights keep their defaults
                continue
            std = residual_std if name.endswith(("attn.out.weight", "mlp.down.weight")) else 0.02
            nn.init.normal_(p, mean=0.0, std=std)
        for m in self.modules():
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        t = idx.shape[1]
        if t > self.cfg.block:
            raise ValueError(f"sequence of {t} tokens; the model takes at most {self.cfg.block}")
        pos = torch.arange(t, device=idx.device)
        x = self.tok(idx) + self.pos(pos)
        for blk in self.blocks:
            x = blk(x)
        logits: torch.Tensor = self.head(self.norm(x))
        if targets is None:
            return logits, None
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        return logits, loss


def random_batches(
    cfg: GPTConfig, batch: int, count: int, device: torch.device | str, seed: int = 0
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`count` (inputs, next-token targets) pairs of random tokens, made on `device`."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    out = []
    for _ in range(count):
        seq = torch.randint(0, cfg.vocab, (batch, cfg.block + 1), generator=gen)
        seq = seq.to(device)
        out.append((seq[:, :-1].contiguous(), seq[:, 1:].contiguous()))
    return out
