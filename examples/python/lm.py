"""A small GPT-style byte-level language model and its data.

The model: token and learned position embeddings, `n_layers` pre-LayerNorm
blocks (causal self-attention, then a GELU MLP, each on a residual branch),
a final LayerNorm and a linear LM head over the 256 byte values. The head is
not tied to the token embedding unless `tie=True`. With the defaults
(d_model 256, 4 layers, 4 heads, context 128) it has 3,323,392 parameters.

The initial values depend only on the seed (they are drawn from a private
generator, not torch's global one), so every process that builds the model
with the same seed gets the same weights.

The data: the repository's own text (README.md and docs/*.md, read as
bytes), split 90/10 into training and validation text. A training batch is
a function of (seed, step) only; rank r of W takes the r-th of W equal
slices of it, so W ranks together see exactly the global batch that one
process would (and the averaged gradient is the one-process gradient).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, List, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB_SIZE = 256
REPO_ROOT = Path(__file__).resolve().parents[2]


# --------------------------------------------------------------------------
# The model
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class LMConfig:
    """The shape of the model."""

    vocab_size: int = VOCAB_SIZE
    context: int = 128
    d_model: int = 256
    n_layers: int = 4
    n_heads: int = 4
    mlp_ratio: int = 4
    tie: bool = False

    def __post_init__(self) -> None:
        if self.d_model % self.n_heads != 0:
            raise ValueError(f"d_model {self.d_model} is not a multiple of n_heads {self.n_heads}")


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention in which position t sees positions <= t."""

    def __init__(self, cfg: LMConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, time, channels = x.shape
        head_dim = channels // self.n_heads
        q, k, v = self.qkv(x).split(channels, dim=2)
        # (batch, heads, time, head_dim)
        q, k, v = (t.view(batch, time, self.n_heads, head_dim).transpose(1, 2) for t in (q, k, v))
        scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(head_dim))
        # The mask is built here rather than kept as a buffer so that the
        # module's state is its parameters only (what zerod shards).
        future = torch.ones(time, time, dtype=torch.bool, device=x.device).triu(1)
        attn = scores.masked_fill(future, float("-inf")).softmax(dim=-1)
        out = (attn @ v).transpose(1, 2).reshape(batch, time, channels)
        return self.proj(out)


class MLP(nn.Module):
    """The feed-forward branch: d_model -> mlp_ratio * d_model -> d_model."""

    def __init__(self, cfg: LMConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, cfg.mlp_ratio * cfg.d_model)
        self.proj = nn.Linear(cfg.mlp_ratio * cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    """One pre-LayerNorm transformer block."""

    def __init__(self, cfg: LMConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """The language model: bytes (batch, time) -> logits (batch, time, vocab)."""

    def __init__(self, cfg: LMConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.context, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie:
            self.head.weight = self.tok_emb.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        time = idx.shape[1]
        if time > self.cfg.context:
            raise ValueError(f"sequence of {time} tokens is longer than the context {self.cfg.context}")
        pos = torch.arange(time, device=idx.device)
        x = self.tok_emb(idx) + self.pos_emb(pos)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def build_model(cfg: LMConfig, seed: int) -> GPT:
    """Builds the model with weights that depend only on `seed`."""
    model = GPT(cfg)
    init_weights(model, seed)
    return model


@torch.no_grad()
def init_weights(model: GPT, seed: int) -> None:
    """GPT-2's initialisation, drawn from a generator seeded with `seed`.

    Linear and embedding weights ~ N(0, 0.02), the projections that end a
    residual branch ~ N(0, 0.02 / sqrt(2 * n_layers)), biases 0, LayerNorm
    scale 1 and shift 0. Parameters are visited in a fixed order, so the
    result does not depend on torch's global random state.
    """
    gen = torch.Generator().manual_seed(seed)
    residual_std = 0.02 / math.sqrt(2 * model.cfg.n_layers)
    for name, module in model.named_modules():
        if isinstance(module, (nn.Linear, nn.Embedding)):
            std = residual_std if name.endswith(".proj") else 0.02
            module.weight.copy_(torch.randn(module.weight.shape, generator=gen) * std)
            if getattr(module, "bias", None) is not None:
                module.bias.zero_()
        elif isinstance(module, nn.LayerNorm):
            module.weight.fill_(1.0)
            module.bias.zero_()


def count_parameters(model: nn.Module) -> int:
    """The number of distinct parameters (a tied weight counts once)."""
    return sum(p.numel() for p in model.parameters())


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over every position of the batch, in nats."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


# --------------------------------------------------------------------------
# The data
# --------------------------------------------------------------------------


def corpus_files(root: Path = REPO_ROOT) -> List[Path]:
    """README.md and docs/*.md of the repository, in a fixed order."""
    files = [root / "README.md"] + sorted((root / "docs").glob("*.md"))
    return [f for f in files if f.is_file()]


def synthetic_text(num_bytes: int, seed: int = 0) -> bytes:
    """Deterministic English-like filler, used when the repository's text is missing."""
    words = ("the daemon holds shards of parameters and optimizer state for "
             "training workers which gather layers reduce gradients and step "
             "every rank in order so that results agree bit for bit").split()
    rng = random.Random(seed)
    out: List[str] = []
    size = 0
    while size < num_bytes:
        sentence = " ".join(rng.choice(words) for _ in range(rng.randint(5, 14)))
        sentence = sentence[0].upper() + sentence[1:] + ". "
        out.append(sentence)
        size += len(sentence)
    return "".join(out).encode()[:num_bytes]


def load_corpus(root: Path = REPO_ROOT, min_bytes: int = 4096) -> bytes:
    """The repository's markdown as bytes, or synthetic text if there is too little."""
    text = b"\n\n".join(f.read_bytes() for f in corpus_files(root))
    if len(text) < min_bytes:
        return synthetic_text(64 * 1024)
    return text


def split_corpus(text: bytes, val_fraction: float = 0.1) -> Tuple[torch.Tensor, torch.Tensor]:
    """The first 90% (by default) for training and the rest for validation, as uint8."""
    data = torch.frombuffer(bytearray(text), dtype=torch.uint8)
    cut = int(len(data) * (1.0 - val_fraction))
    return data[:cut], data[cut:]


def _windows(data: torch.Tensor, starts: Iterable[int], context: int) -> Tuple[torch.Tensor, torch.Tensor]:
    rows = torch.stack([data[s : s + context + 1] for s in starts]).long()
    return rows[:, :-1], rows[:, 1:]


def get_batch(
    data: torch.Tensor,
    step: int,
    rank: int,
    world_size: int,
    global_batch: int,
    context: int,
    seed: int,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Rank `rank`'s share of the global batch of `step`: (inputs, targets).

    The global batch (its `global_batch` window offsets) depends only on
    (seed, step); rank r takes rows [r * B / W, (r + 1) * B / W).
    """
    if global_batch % world_size != 0:
        raise ValueError(f"global batch {global_batch} is not a multiple of {world_size} ranks")
    if len(data) <= context + 1:
        raise ValueError(f"{len(data)} bytes of data is too little for a context of {context}")
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
    starts = torch.randint(0, len(data) - context - 1, (global_batch,), generator=gen)
    per_rank = global_batch // world_size
    return _windows(data, starts[rank * per_rank : (rank + 1) * per_rank].tolist(), context)


def val_batches(data: torch.Tensor, num_batches: int, batch: int, context: int) -> List[Tuple[torch.Tensor, torch.Tensor]]:
    """Fixed validation batches: windows spread evenly over the validation text."""
    count = num_batches * batch
    last = len(data) - context - 1
    if last < 0:
        raise ValueError(f"{len(data)} bytes of validation data is too little for a context of {context}")
    starts = [last * i // max(1, count - 1) for i in range(count)]
    return [_windows(data, starts[b * batch : (b + 1) * batch], context) for b in range(num_batches)]


@torch.no_grad()
def evaluate(model: nn.Module, batches: List[Tuple[torch.Tensor, torch.Tensor]]) -> float:
    """Mean loss over `batches` (the model is left in training mode)."""
    total = 0.0
    for inputs, targets in batches:
        total += lm_loss(model(inputs), targets).item()
    return total / max(1, len(batches))


@torch.no_grad()
def generate(
    model: nn.Module,
    prompt: bytes,
    num_bytes: int,
    context: int,
    temperature: float = 0.8,
    seed: int = 0,
) -> bytes:
    """Continues `prompt` by `num_bytes` bytes; temperature 0 is greedy.

    Sampling uses its own generator, so the result depends only on the
    model, the prompt and the seed.
    """
    gen = torch.Generator().manual_seed(seed)
    idx = torch.tensor([list(prompt or b"\n")], dtype=torch.long)
    for _ in range(num_bytes):
        logits = model(idx[:, -context:])[0, -1]
        if temperature <= 0:
            next_byte = logits.argmax().view(1, 1)
        else:
            probs = (logits / temperature).softmax(dim=-1)
            next_byte = torch.multinomial(probs, 1, generator=gen).view(1, 1)
        idx = torch.cat([idx, next_byte], dim=1)
    return bytes(idx[0, len(prompt or b"\n") :].tolist())


def printable(text: bytes) -> str:
    """Decodes generated bytes for a terminal: invalid UTF-8 and control characters replaced."""
    decoded = text.decode("utf-8", errors="replace")
    return "".join(c if c in "\n\t" or c.isprintable() else "\ufffd" for c in decoded)


def lr_lambda_warmup_cosine(warmup_steps: int, total_steps: int, min_ratio: float = 0.1):
    """A LambdaLR factor: linear warmup to 1, then cosine decay to `min_ratio`."""

    def factor(step: int) -> float:
        if warmup_steps > 0 and step < warmup_steps:
            return (step + 1) / warmup_steps
        span = max(1, total_steps - warmup_steps)
        progress = min(1.0, (step - warmup_steps) / span)
        return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return factor


def describe(cfg: LMConfig, params: Optional[int] = None) -> str:
    """One line about the model's shape."""
    tied = ", tied head" if cfg.tie else ""
    size = f"{params:,} parameters, " if params is not None else ""
    return (f"{size}d_model {cfg.d_model}, {cfg.n_layers} layers, {cfg.n_heads} heads, "
            f"context {cfg.context}, vocab {cfg.vocab_size}{tied}")
