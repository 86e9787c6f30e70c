"""ShardedModule and shard(): a torch.nn.Module whose parameters live in
zerod, registered with the daemon unit by unit."""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from typing import Any, Dict, Iterator, List, Union

import numpy as np
import torch
from torch import nn

from ..client import Job, Unit
from ..errors import InvalidArgumentError, ShardingError
from ._clip import clip_state
from ._hooks import _TORCH_DTYPES, _State, _install_hooks
from ._plan import BaseNames, UnitsPolicy, _plan, _ShardedUnit, _split_base, base_name

class ShardedModule(nn.Module):
    """A module whose parameters live in zerod (see :func:`shard`).

    ``forward`` runs the wrapped module. ``state_dict`` gathers the full
    weights from the service (a collective: call it on every rank) and
    returns them under the wrapped module's own names, so the result loads
    into an unsharded copy of the model; ``load_state_dict`` sets them
    through the service (also a collective)."""

    def __init__(self, module: nn.Module, state: _State) -> None:
        super().__init__()
        self.module = module
        self._zerod = state

    @property
    def job(self) -> Job:
        return self._zerod.job

    @property
    def units(self) -> List[Unit]:
        """The zerod units, in registration order."""
        return [u.zunit for u in self._zerod.units]

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    def recover(self, timeout_s: float = 300.0) -> int:
        """Goes on after a request failed because the job was rebuilt under
        this worker (a node lost, the job moved or restored, its ranks
        failed: docs/redundancy.md): attaches again (:meth:`zerod.Job.recover`),
        binds the model to the recovered job's units and has its optimizer
        send its settings again. Returns the job's step now: the step that
        completed last, from which training goes on (the batch of the next
        step comes next; what the failed step computed is dropped). Every
        rank calls it, as it runs into the failure."""
        state = self._zerod
        job = state.job.recover(timeout_s)
        state.rebind(job)
        _match_listed(job, state.units)
        if state.optimizer is not None:
            state.optimizer._rebind(job)
        return int(job.stats()[0]["step"])

    def set_requires_gradient_sync(self, requires_gradient_sync: bool) -> None:
        """FSDP2's switch: False makes the backward passes that follow add
        their gradients into the units' gradient buffers (shared memory in
        the daemon's pool, counted in max_live_bytes) and reduce nothing;
        the first backward with True adds its own and reduces the sum."""
        self._zerod.sync = bool(requires_gradient_sync)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0,
                        error_if_nonfinite: bool = False) -> torch.Tensor:
        """FSDP's ``clip_grad_norm_``: the global norm of every rank's
        gradients (the daemon's), returned; the next step clips by it.
        Needs the model's :class:`zerod.torch.Optimizer`."""
        return clip_state(self._zerod, max_norm, norm_type, error_if_nonfinite)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """DDP's gradient accumulation: backward passes inside accumulate
        without a collective; the next one outside reduces their sum with
        its own (every rank must run the same passes inside and outside)."""
        previous = self._zerod.sync
        self._zerod.sync = False
        try:
            yield
        finally:
            self._zerod.sync = previous

    def _full_values(self) -> Dict[int, torch.Tensor]:
        """id(parameter) -> a copy of its full value, from the service."""
        state = self._zerod
        if state.pending():
            raise ShardingError("state_dict during a backward pass (units %s)" % state.pending())
        values: Dict[int, torch.Tensor] = {}
        for unit in state.units:
            if unit.gathered or unit.bwd_gathered:
                for param, view in zip(unit.params, unit.views):
                    values[id(param)] = view.detach().clone()
                continue
            with unit.zunit.gather() as gathered:
                tensors = gathered.tensors()
                for param, name in zip(unit.params, unit.names):
                    values[id(param)] = tensors[name].clone()
        return values

    def state_dict(self, *args: Any, destination: Any = None, prefix: str = "",
                   keep_vars: bool = False) -> "OrderedDict[str, torch.Tensor]":
        if args:
            raise TypeError("ShardedModule.state_dict takes keyword arguments only")
        values = self._full_values()
        local = self.module.state_dict(prefix=prefix, keep_vars=True)
        out: "OrderedDict[str, torch.Tensor]" = OrderedDict() if destination is None else destination
        for key, value in local.items():
            if isinstance(value, nn.Parameter) and id(value) in values:
                out[key] = values[id(value)]
            else:
                out[key] = value if keep_vars else value.detach()
        return out

    def load_state_dict(self, state_dict: "Dict[str, torch.Tensor]", strict: bool = True) -> Any:
        state = self._zerod
        if state.job.read_only:
            raise ShardingError("load_state_dict on a read-only job")
        local = self.module.state_dict(keep_vars=True)
        missing = [k for k in local if k not in state_dict]
        unexpected = [k for k in state_dict if k not in local]
        if strict and (missing or unexpected):
            raise RuntimeError("Error(s) in loading state_dict for %s: missing keys %s, unexpected "
                               "keys %s" % (type(self.module).__name__, missing, unexpected))
        # Units of the base keep the base's values (they cannot be loaded);
        # the dict's values for them are not used.
        own = [unit for unit in state.units if not unit.from_base]
        by_param: Dict[int, torch.Tensor] = {}
        for key, value in local.items():
            if key in state_dict and isinstance(value, nn.Parameter):
                by_param.setdefault(id(value), state_dict[key])
        # Every rank checks (all pass the same dict), so a bad dict fails
        # everywhere before the first collective.
        for unit in own:
            for param, name, shape in zip(unit.params, unit.names, unit.shapes):
                value = by_param.get(id(param))
                if value is not None and tuple(value.shape) != tuple(shape):
                    raise RuntimeError("size mismatch for %s: copying a param with shape %s, "
                                       "the shape in the sharded model is %s" %
                                       (name, tuple(value.shape), tuple(shape)))
        # Parameters the dict leaves out (strict=False) keep their values.
        keep = any(id(p) not in by_param for unit in own for p in unit.params)
        current = self._full_values() if keep else {}
        for unit in own:
            values = None
            if state.job.rank == 0:
                values = np.concatenate([
                    by_param.get(id(p), current.get(id(p))).detach().to(torch.float32).reshape(-1)
                    .numpy() for p in unit.params])
            unit.zunit.load(values)
        with torch.no_grad():
            for key, value in local.items():
                if not isinstance(value, nn.Parameter) and key in state_dict:
                    value.copy_(state_dict[key])
        return torch.nn.modules.module._IncompatibleKeys(missing, unexpected)


def shard(model: nn.Module, job: Job, units: UnitsPolicy = "per-module",
          base: Union[bool, BaseNames] = False) -> ShardedModule:
    """Moves `model`'s parameters into zerod and returns the model wrapped.

    `units` chooses the granule of gathering: ``"per-module"`` (every module
    with parameters of its own), a list of module classes (each instance,
    with its submodules, is one unit, e.g. ``[Block]``), or a callable
    ``(module, qualified_name) -> bool``. Parameters outside every chosen
    module form the model's own unit; a parameter held by several modules
    (tied weights) belongs to the innermost unit that encloses them all.

    Read-write jobs register every unit (a collective: call on every rank
    with the same model); rank 0's values become everyone's initial values
    (the daemon keeps an existing unit's state when the job already has it).
    On a read-only job the units must already exist; forward passes then
    read the job's pinned weights. Buffers stay local to each process.

    ``base=True`` trains on the job's base (``JobConfig(base_job=...)``;
    docs/python.md, "Jobs on a base"): the frozen parameters
    (``requires_grad=False``) are the base's, registered as references to
    its units (nothing is sent; their values in `model` are not used), and
    the trainable ones (LoRA's A and B, heads) are the job's own units. A
    unit module holding both is split: its frozen parameters make the unit
    the base has under the module's name, its trainable ones the job's unit
    ``<path>#own``. Names are mapped to the plain model's by
    :func:`zerod.torch.base_name` (peft's ``base_model.model.`` and
    ``.base_layer`` dropped), or by `base` itself when it is a callable
    ``name -> name``; `units` must be the policy the base's model was
    sharded with, so that the units line up. Base units are never given a
    gradient, reduced, stepped or loaded.
    """
    if isinstance(model, ShardedModule):
        raise ShardingError("the model is already sharded")
    if not isinstance(job, Job):
        raise InvalidArgumentError("job must be a zerod.Job (from zerod.Client().attach)")
    plan = _plan(model, units)
    if base is not False and base is not None:
        if not job.read_only and not job.effective_config.base_job:
            raise ShardingError("shard(..., base=...): job %s has no base (attach it with "
                                "zerod.JobConfig(base_job=NAME))" % job.name)
        plan = _split_base(plan, base if callable(base) else base_name)
    state = _State(job, plan)
    for unit in plan:
        for param, name in zip(unit.params, unit.names):
            if not param.is_floating_point():
                raise ShardingError("parameter %s has dtype %s: only floating-point parameters "
                                    "can be sharded" % (name, param.dtype))
            if param.device.type != "cpu":
                raise ShardingError("parameter %s is on %s: zerod.torch shards CPU modules "
                                    "(GPU ranks are not supported yet)" % (name, param.device))
    if job.read_only:
        _match_listed(job, plan)
    else:
        _register(job, plan)
    state.dtype = _TORCH_DTYPES[plan[0].zunit._dtype_code] if plan else torch.float32
    state.placeholder = torch.full((1,), float("nan"), dtype=state.dtype)
    for unit in plan:
        for param in unit.params:
            param._zerod_state = state  # what clip_grad_norm_ below recognizes
    for unit in plan:
        for param in unit.params:
            param.grad = None
            if param.dtype != state.dtype:
                param.data = param.data.to(state.dtype)
        # While the parameters still have their full shapes and the working
        # dtype: autograd records both in each AccumulateGrad node.
        _install_hooks(state, unit)
        state.unbind(unit)
    return ShardedModule(model, state)


def _register(job: Job, plan: List[_ShardedUnit]) -> None:
    for unit in plan:
        specs = [(name, tuple(p.shape), not p.requires_grad)
                 for name, p in zip(unit.names, unit.params)]
        if unit.from_base:
            unit.zunit = job.register(unit.name, specs, from_base=True)
            _check_layout(unit)
            continue
        values = None
        if job.rank == 0:
            values = np.concatenate(
                [p.detach().to(torch.float32).reshape(-1).numpy() for p in unit.params])
        unit.zunit = job.register(unit.name, specs, init="rank0", values=values)
        _check_layout(unit)


def _match_listed(job: Job, plan: List[_ShardedUnit]) -> None:
    listed = {u.name: u for u in job.list_units()}
    for unit in plan:
        if unit.name not in listed:
            raise ShardingError("job %s has no unit %s (it has: %s)" %
                                (job.name, unit.name, ", ".join(sorted(listed)) or "none"))
        unit.zunit = listed[unit.name]
        unit.zunit.from_base = unit.from_base
        _check_layout(unit)


def _check_layout(unit: _ShardedUnit) -> None:
    tensors = unit.zunit.tensors
    by_name = {t.name: t for t in tensors}
    if unit.from_base and len(by_name) == len(unit.names) and set(by_name) == set(unit.names):
        # A base's unit is laid out in the base's order (one made from a
        # safetensors file has its tensors by name): the hooks index the
        # tensors as the model's parameters are.
        tensors = unit.zunit.tensors = tuple(by_name[n] for n in unit.names)
    if len(tensors) != len(unit.params):
        raise ShardingError("unit %s has %d tensors in zerod, %d in the model" %
                            (unit.name, len(tensors), len(unit.params)))
    for t, name, shape in zip(tensors, unit.names, unit.shapes):
        if t.name != name or tuple(t.shape) != tuple(shape):
            raise ShardingError("unit %s: zerod has %s %s where the model has %s %s" %
                                (unit.name, t.name, t.shape, name, tuple(shape)))
