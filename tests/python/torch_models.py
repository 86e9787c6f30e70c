"""Small models and deterministic data shared by the zerod.torch tests and
their worker processes (torch_worker.py)."""

from __future__ import annotations

import torch
from torch import nn
import torch.nn.functional as F

VOCAB = 64
WIDTH = 32
SEQ = 8


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class TinyLM(nn.Module):
    """Embedding, two residual MLP blocks, a head; optionally the head tied
    to the embedding; a buffer used in forward (stays local)."""

    def __init__(self, tie: bool = False, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList([Block(WIDTH) for _ in range(2)])
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        if tie:
            self.head.weight = self.embed.weight
        self.register_buffer("gain", torch.full((WIDTH,), 0.5))

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) * (1 + self.gain)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def batch(step: int, global_batch: int, rank: int = 0, world: int = 1, seed: int = 1):
    """Rank `rank`'s share of the global batch of `step`: tokens and their
    targets (a fixed permutation of the vocabulary, learnable)."""
    g = torch.Generator().manual_seed(seed * 100003 + step)
    tokens = torch.randint(0, VOCAB, (global_batch, SEQ), generator=g)
    targets = (tokens * 5 + 3) % VOCAB
    per = global_batch // world
    return tokens[rank * per:(rank + 1) * per], targets[rank * per:(rank + 1) * per]


def schedule(step: int) -> float:
    """Warm-up then step decay, for LambdaLR."""
    return min(1.0, (step + 1) / 5) * 0.5 ** (step // 10)


def train(model: nn.Module, opt, steps: int, global_batch: int, rank: int = 0, world: int = 1,
          accum: int = 1, clip: float = 0.0, use_schedule: bool = False, zerod_opt: bool = False):
    """The training program both sides run: `accum` micro-batches per step
    (loss divided by accum), optional clipping and LR schedule."""
    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule) if use_schedule else None
    losses = []
    for step in range(steps):
        for micro in range(accum):
            tokens, targets = batch(step * accum + micro, global_batch, rank, world)
            loss = model(tokens, targets) / accum
            loss.backward()
            losses.append(float(loss) * accum)
        if clip > 0:
            if zerod_opt:
                opt.clip_grad_norm_(clip)
            else:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
        if sched is not None:
            sched.step()
    return losses
