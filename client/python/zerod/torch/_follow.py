"""zerod.torch.follow: a plain torch module (an inference copy) that takes
each new version of a training job's weights in place (docs/subscribe.md).
"""

from __future__ import annotations

from typing import Dict, Iterator, Optional

import torch
from torch import nn

from .._subscribe import Subscription, Update
from ..client import Client


def _parameters(model: nn.Module) -> Dict[str, torch.Tensor]:
    """The model's parameters and buffers by qualified name, the names
    zerod.torch.shard registers tensors under (a tied parameter under its
    first name)."""
    named = dict(model.named_buffers())
    named.update(model.named_parameters())
    return named


def load_update(model: nn.Module, update: Update) -> int:
    """Brings the model's parameters of the update's tensors to its
    version, in place, converting to each parameter's dtype, with delta
    gathers (Update.apply): a unit this subscription loaded before gets only
    the blocks that changed since. Returns the elements copied. A tensor the
    model has no parameter for, or one of another shape, is an error that
    names it (the model is not the one the job trains); nothing of the
    update is copied then."""
    params = _parameters(model)
    for unit in update.units:
        for t in unit.tensors:
            if t.name not in params:
                raise KeyError("zerod.torch.follow: job %s has tensor %s, which the model lacks "
                               "(its parameters: %s...)" % (update.job.name, t.name,
                                                           ", ".join(sorted(params)[:5])))
            if tuple(params[t.name].shape) != tuple(t.shape):
                raise ValueError("zerod.torch.follow: tensor %s is %s in job %s but %s in the "
                                 "model" % (t.name, tuple(t.shape), update.job.name,
                                            tuple(params[t.name].shape)))
    with torch.no_grad():
        return update.apply({name: p.data for name, p in params.items()})


def follow(model: nn.Module, job: str, *, client: Optional[Client] = None,
           socket: Optional[str] = None, token: Optional[str] = None,
           timeout_s: Optional[float] = None) -> Iterator[Update]:
    """Loads each new version of `job`'s weights into `model` in place and
    yields its :class:`zerod.Update` (version, step, skipped) once loaded;
    the first update brings every unit. Between updates the model is
    untouched, so inference runs on whole versions only. A wait longer than
    `timeout_s` ends the iteration (None: wait forever). Attaches read-only
    through `client` (default: a new one on `socket`, else the local
    daemon), with `token` (default: $ZEROD_TOKEN)."""
    own = client is None
    client = client or Client(socket)
    try:
        with Subscription(client, job, token=token, timeout_s=timeout_s) as subscription:
            for update in subscription:
                load_update(model, update)
                yield update
    finally:
        if own:
            client.close()
