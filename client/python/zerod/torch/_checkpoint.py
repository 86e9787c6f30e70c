"""Checkpoints from the training loop: the job's tensors as a state dict,
and service checkpoints saved and restored by the workers."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Optional

import torch

from ..client import CheckpointInfo, Job
from ..errors import InvalidArgumentError, ShardingError
from ._hooks import _State
from ._optim import Optimizer

def state_dict_from(job: Job) -> "OrderedDict[str, torch.Tensor]":
    """Every tensor of `job` as torch tensors (copies), by the names the
    training model registered; for a pinned read-only job all from one
    version. Loads into an unsharded copy of the model."""
    if job.read_only:
        job.list_units()
    out: "OrderedDict[str, torch.Tensor]" = OrderedDict()
    for unit in job.units:
        with unit.gather() as gathered:
            for name, tensor in gathered.tensors().items():
                out[name] = tensor.clone()
    return out


def _state_of(obj: Any, what: str) -> "_State":
    state = getattr(obj, "_zerod", None)
    if isinstance(obj, Optimizer):
        state = obj._model._zerod
    if not isinstance(state, _State):
        raise InvalidArgumentError("%s: expected a zerod.torch.ShardedModule or its "
                                   "zerod.torch.Optimizer, not %s" % (what, type(obj).__name__))
    return state


def _between_steps(state: "_State", what: str) -> None:
    pending = state.pending()
    gathered = [u.name for u in state.units if u.gathered > 0]
    if pending or gathered:
        raise ShardingError("%s inside a forward or backward pass (units %s): call it between "
                            "steps" % (what, pending + gathered))
    unreduced = state.unreduced()
    if unreduced:
        raise ShardingError("%s with gradients of units %s accumulated under no_sync and not "
                            "stepped: call it between steps" % (what, unreduced))


def save(model: Any, name: Optional[str] = None) -> CheckpointInfo:
    """Saves the sharded model's job as a service checkpoint: every rank's
    shard of the fp32 master weights and optimizer state, written by the
    daemons in parallel into their checkpoint directory, atomically (as
    ``zerodctl checkpoint save``; docs/checkpoints.md). Nothing is gathered
    into this process.

    A collective, as ``torch.distributed.checkpoint.save``: every rank
    calls it with the same `name` between the same two steps (None names it
    ``step-<step>``); each returns once the checkpoint is durable. `model`
    is the ShardedModule or its Optimizer. Learning-rate schedulers, data
    loaders and the like are yours to save (``torch.save`` of their
    state_dict); the parameter groups and loss scale are the optimizer's,
    sent again when it is made."""
    state = _state_of(model, "zerod.torch.save")
    _between_steps(state, "zerod.torch.save")
    return state.job.save_checkpoint(name)


def load(model: Any, name: str) -> CheckpointInfo:
    """Restores the sharded model's job from its service checkpoint `name`
    (one that zerod.torch.save, ``zerodctl checkpoint save`` or a periodic
    policy took): master weights, optimizer moments and step, re-sharded if
    the job's world differs from the one that saved it. The model and its
    Optimizer see the restored values at the next forward and step.

    A collective like save; on failure (no such checkpoint, a damaged
    file) the job keeps its state. Returns the checkpoint with the job's
    step now."""
    state = _state_of(model, "zerod.torch.load")
    _between_steps(state, "zerod.torch.load")
    return state.job.restore_checkpoint(name)
