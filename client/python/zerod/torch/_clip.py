"""clip_grad_norm_ for sharded models, and the opt-in that installs it in
place of torch.nn.utils.clip_grad_norm_."""

from __future__ import annotations

from typing import Any, Callable

import torch

from ..errors import ShardingError

# torch.nn.utils.clip_grad_norm_ for sharded models. Their gradients are in
# the daemon by the time a training loop clips (each unit's go there as soon
# as its backward is done), so torch's own function would find no .grad and
# return 0 without clipping anything. This one hands sharded parameters to
# their model's optimizer (the daemon computes the norm over every rank's
# gradients and the step clips) and passes any other call to torch's.
# Importing zerod.torch changes nothing in torch: a training loop calls
# model.clip_grad_norm_(c) (as with FSDP), this function, or, to keep
# torch.nn.utils.clip_grad_norm_(model.parameters(), c) as it is written,
# installs this one in its place with patch_clip_grad_norm_().
_torch_clip_grad_norm_ = torch.nn.utils.clip_grad_norm_


def clip_grad_norm_(parameters: Any, max_norm: float, norm_type: float = 2.0,
                    *args: Any, **kwargs: Any) -> torch.Tensor:
    """torch.nn.utils.clip_grad_norm_ that knows sharded models: for the
    parameters of a sharded model (all of them, as ``model.parameters()``
    gives them) the daemon computes the global norm and the next step
    clips; other parameters go to torch's function."""
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    states = {id(getattr(p, "_zerod_state", None)): getattr(p, "_zerod_state", None)
              for p in params}
    if list(states) == [id(None)]:
        return _torch_clip_grad_norm_(params, max_norm, norm_type, *args, **kwargs)
    if len(states) != 1:
        raise ShardingError("clip_grad_norm_ over parameters of a sharded model and others at "
                            "once: clip each set alone")
    state = next(iter(states.values()))
    trainable = {id(p) for unit in state.units for p in unit.params if p.requires_grad}
    if {id(p) for p in params if p.requires_grad} != trainable:
        raise ShardingError("zerod clips by the norm of all of a sharded model's gradients: pass "
                            "model.parameters()")
    error_if_nonfinite = kwargs.get("error_if_nonfinite", args[0] if args else False)
    return clip_state(state, max_norm, norm_type, bool(error_if_nonfinite))


def clip_state(state: Any, max_norm: float, norm_type: float,
               error_if_nonfinite: bool) -> torch.Tensor:
    """Clipping of the sharded model whose hooks' state is `state`."""
    if state.optimizer is None:
        raise ShardingError("clip_grad_norm_ on a sharded model needs its zerod.torch.Optimizer "
                            "(made before the first backward)")
    return state.optimizer.clip_grad_norm_(max_norm, float(norm_type),
                                           error_if_nonfinite=error_if_nonfinite)


def patch_clip_grad_norm_() -> Callable[[], None]:
    """Opt-in: installs :func:`clip_grad_norm_` as
    ``torch.nn.utils.clip_grad_norm_`` for the whole process, so that a
    training loop's ``torch.nn.utils.clip_grad_norm_(model.parameters(), c)``
    clips a sharded model unchanged (other parameters still reach torch's
    function). Returns a function that puts torch's back."""
    torch.nn.utils.clip_grad_norm_ = clip_grad_norm_

    def restore() -> None:
        if torch.nn.utils.clip_grad_norm_ is clip_grad_norm_:
            torch.nn.utils.clip_grad_norm_ = _torch_clip_grad_norm_

    return restore
