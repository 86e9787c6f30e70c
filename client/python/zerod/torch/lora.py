"""A plain LoRA module (no dependency): LoRALinear and apply_lora.

LoRA (Hu et al., 2021) trains a low-rank update of a frozen weight:
``y = x W^T + b + (x A^T) B^T * alpha / r``, with A (r x in) drawn as
peft draws it (Kaiming uniform) and B (out x r) zero, so the adapted model
starts equal to the plain one. LoRALinear keeps its layer's own
``weight`` and ``bias`` Parameters under their own names, so a LoRA
model's frozen parameters are named as in the plain model: on a base
(``zerod.torch.shard(model, job, base=True)``) they line up with the
base's units without any mapping, and only ``lora_A`` and ``lora_B`` are
the job's.
"""

from __future__ import annotations

import math
from typing import Iterable, List, Union

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import InvalidArgumentError


class LoRALinear(nn.Module):
    """An nn.Linear with a trainable low-rank update: the layer's weight and
    bias (the same Parameters, frozen) plus ``lora_A`` (r x in_features)
    and ``lora_B`` (out_features x r, zero), scaled by ``alpha / r``."""

    def __init__(self, linear: nn.Linear, r: int = 8, alpha: float = 16.0) -> None:
        super().__init__()
        if not isinstance(linear, nn.Linear):
            raise InvalidArgumentError("LoRALinear wraps an nn.Linear, not %s" %
                                       type(linear).__name__)
        if int(r) < 1:
            raise InvalidArgumentError("LoRA rank r must be 1 or more, not %r" % (r,))
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.r = int(r)
        self.alpha = float(alpha)
        self.scaling = self.alpha / self.r
        self.weight = linear.weight
        self.weight.requires_grad_(False)
        if linear.bias is not None:
            self.bias = linear.bias
            self.bias.requires_grad_(False)
        else:
            self.register_parameter("bias", None)
        factory = dict(dtype=linear.weight.dtype, device=linear.weight.device)
        self.lora_A = nn.Parameter(torch.empty(self.r, self.in_features, **factory))
        self.lora_B = nn.Parameter(torch.zeros(self.out_features, self.r, **factory))
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))  # peft's and nn.Linear's

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (F.linear(x, self.weight, self.bias) +
                F.linear(F.linear(x, self.lora_A), self.lora_B) * self.scaling)

    def extra_repr(self) -> str:
        return "in_features=%d, out_features=%d, bias=%s, r=%d, alpha=%g" % (
            self.in_features, self.out_features, self.bias is not None, self.r, self.alpha)


def _matches(path: str, targets: List[str]) -> bool:
    """peft's rule for a list of target_modules: the module's qualified name
    is a target or ends with "." and a target."""
    return any(path == t or path.endswith("." + t) for t in targets)


def apply_lora(model: nn.Module, target_modules: Union[str, Iterable[str]], r: int = 8,
               alpha: float = 16.0) -> nn.Module:
    """Freezes every parameter of `model` and replaces each nn.Linear whose
    qualified name is one of `target_modules` or ends with "." and one of
    them (peft's rule: ``["up", "down"]`` takes every block's) by a
    LoRALinear of rank `r`; returns `model`, changed in place. Other
    parameters (a head to train, say) can be unfrozen afterwards with
    ``requires_grad_(True)``. Raises InvalidArgumentError if no module
    matched."""
    targets = [target_modules] if isinstance(target_modules, str) else list(target_modules)
    for p in model.parameters():
        p.requires_grad_(False)
    chosen = [(path, module) for path, module in model.named_modules()
              if path and isinstance(module, nn.Linear) and _matches(path, targets)]
    if not chosen:
        raise InvalidArgumentError("apply_lora: no nn.Linear of the model matches %s" % targets)
    for path, linear in chosen:
        parent_path, _, attr = path.rpartition(".")
        parent = model.get_submodule(parent_path) if parent_path else model
        setattr(parent, attr, LoRALinear(linear, r=r, alpha=alpha))
    return model
