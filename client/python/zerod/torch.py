"""zerod.torch: train a torch.nn.Module whose parameters live in zerod.

::

    job = zerod.Client().attach("lm", rank=local_rank, config=zerod.JobConfig(lr=3e-4))
    model = zerod.torch.shard(model, job, units=[Block])
    opt = zerod.torch.Optimizer(model)
    for x, y in data:
        loss = model(x, y)
        loss.backward()            # gradients go to the daemon unit by unit
        opt.clip_grad_norm_(1.0)   # optional, applied inside the step
        opt.step()                 # the daemon's AdamW/Adam/SGD step
        opt.zero_grad()

How it works (FSDP's scheme, with the daemon holding the shards):

* :func:`shard` groups the parameters into units (one per module with
  parameters, or per module chosen by `units`), registers every unit with
  the daemon (rank 0's values become everyone's initial values) and
  replaces each parameter's data with a placeholder of its shape that
  takes no memory: one NaN, broadcast (so ``numel()``, ``shape`` and
  parameter counts stay those of the model, as with FSDP2, and reading the
  values outside a forward pass gives NaN, not numbers that look right;
  :meth:`ShardedModule.state_dict` gathers the real ones).
* A forward pre-hook on a unit's module gathers the unit and points its
  parameters at the gathered buffer (shared memory, no copy); the forward
  hook releases it and puts the placeholders back.
* A hook on the module's outputs gathers the unit again when backward
  reaches it. The gathered view always lies at the same address
  (``stable_addresses``), so tensors that autograd saved during the forward
  pass, views of the weights included, read the right values.
* When every parameter of the unit has its gradient, the gradients are
  copied into the unit's gradient buffer and reduced into the daemon's
  accumulators, the parameters' ``.grad`` is cleared and the unit released.

Every rank must run the same forward and backward program (the same units
in the same order): gathers and reduces are collectives of the job.
"""

from __future__ import annotations

import contextlib
import ctypes
import math
from collections import OrderedDict
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple, Union

import numpy as np
import torch
from torch import nn

from . import _lib
from .client import CheckpointInfo, Job, StepResult, Unit, _check
from .errors import InvalidArgumentError, ShardingError

__all__ = ["shard", "ShardedModule", "Optimizer", "state_dict_from", "save", "load"]

UnitsPolicy = Union[str, Sequence[type], Callable[[nn.Module, str], bool]]

_TORCH_DTYPES = {_lib.F32: torch.float32, _lib.BF16: torch.bfloat16, _lib.F16: torch.float16}


def _require_host(view: _lib.View, unit_name: str) -> None:
    """zerod.torch wraps shared memory only: a GPU buffer (zerod --device
    cuda) holds a device pointer that must never be read as host memory."""
    if int(view.device) >= 0:
        raise ShardingError(
            "unit %s: zerod keeps this job on GPU %d (zerod --device cuda); zerod.torch "
            "supports daemons with --device cpu only" % (unit_name, int(view.device)))


class _Ref:
    """One place a parameter is held: ``module._parameters[attr]``."""

    __slots__ = ("module", "attr", "path")

    def __init__(self, module: nn.Module, attr: str, path: str) -> None:
        self.module = module
        self.attr = attr
        self.path = path


class _ShardedUnit:
    """Bookkeeping of one unit: its module, parameters and buffers."""

    def __init__(self, index: int, name: str, module: nn.Module) -> None:
        self.index = index
        self.name = name
        self.module = module
        self.params: List[nn.Parameter] = []
        self.names: List[str] = []
        self.refs: List[List[_Ref]] = []
        self.shapes: List[torch.Size] = []
        self.zunit: Optional[Unit] = None
        self.flat: Optional[torch.Tensor] = None  # over the stable gathered address
        self.address = 0
        self.views: List[torch.Tensor] = []
        self.gathered = 0  # forward gathers in flight (re-entrant modules)
        self.bwd_gathered = False
        self.prefetch: Optional[_lib.Pending] = None  # a gather sent ahead of backward
        self.grad_params = 0  # parameters that need a gradient
        self.grads_ready = 0
        # Its gradient buffer holds micro-batches' gradients that no reduce
        # has taken yet (backward passes under no_sync).
        self.accumulated = False
        self.grad_hooks: List[Any] = []  # keeps the AccumulateGrad nodes alive


def _walk(module: nn.Module, prefix: str, seen: List[nn.Module]) -> Iterator[Tuple[str, nn.Module]]:
    """Every (path, module), shared modules once per path, in pre-order."""
    if any(m is module for m in seen):
        raise ShardingError("module %s contains itself" % (prefix or "<root>"))
    yield prefix, module
    seen.append(module)
    for name, child in module._modules.items():
        if child is not None:
            yield from _walk(child, prefix + "." + name if prefix else name, seen)
    seen.pop()


def _is_root(policy: UnitsPolicy, module: nn.Module, path: str) -> bool:
    if isinstance(policy, str):
        if policy != "per-module":
            raise InvalidArgumentError(
                "units must be 'per-module', a list of module classes or a callable, not %r" %
                policy)
        return any(p is not None for p in module._parameters.values())
    if callable(policy) and not isinstance(policy, type):
        return bool(policy(module, path))
    classes = tuple(policy)
    if not all(isinstance(c, type) for c in classes):
        raise InvalidArgumentError("units: a list of module classes expected, got %r" % (policy,))
    return isinstance(module, classes)


def _plan(model: nn.Module, policy: UnitsPolicy) -> List[_ShardedUnit]:
    """Groups the parameters into units.

    A parameter belongs to the deepest unit module that encloses every
    module holding it, so a tied parameter (the same Parameter in two
    modules) lands in a unit that is gathered whenever either uses it.
    The model itself is always a unit module (for what no other takes).
    """
    paths = list(_walk(model, "", []))
    roots = {id(model): model}
    for path, module in paths:
        if path and _is_root(policy, module, path):
            roots[id(module)] = module
    # Every place each parameter is held, in pre-order.
    holders: "OrderedDict[int, Tuple[nn.Parameter, List[_Ref]]]" = OrderedDict()
    for path, module in paths:
        for attr, param in module._parameters.items():
            if param is None:
                continue
            qual = path + "." + attr if path else attr
            entry = holders.setdefault(id(param), (param, []))
            entry[1].append(_Ref(module, attr, qual))
    module_at = {path: module for path, module in paths}

    def owner_path(param_paths: List[str]) -> str:
        # The deepest common module path of all holders (holders are modules).
        split = [p.split(".")[:-1] for p in param_paths]
        common: List[str] = []
        for parts in zip(*split):
            if all(x == parts[0] for x in parts):
                common.append(parts[0])
            else:
                break
        # Walk up to the nearest unit module.
        while common and id(module_at[".".join(common)]) not in roots:
            common.pop()
        return ".".join(common)

    units: "OrderedDict[str, _ShardedUnit]" = OrderedDict()
    order = {path: i for i, (path, _) in enumerate(paths)}
    assignments: List[Tuple[str, nn.Parameter, List[_Ref]]] = []
    for param, refs in holders.values():
        assignments.append((owner_path([r.path for r in refs]), param, refs))
    # Units in the pre-order of their modules; tensors in the order found.
    for path in sorted({a[0] for a in assignments}, key=lambda p: order[p]):
        units[path] = _ShardedUnit(len(units), path or "<root>", module_at[path])
    for path, param, refs in assignments:
        unit = units[path]
        unit.params.append(param)
        unit.names.append(refs[0].path)
        unit.refs.append(refs)
        unit.shapes.append(param.shape)
    return list(units.values())


def _tensors_in(value: Any) -> Iterator[torch.Tensor]:
    """Tensors inside a forward's output (tensors, tuples, lists, dicts)."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors_in(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors_in(item)


class _State:
    """What a ShardedModule keeps: the job, its units, hook state."""

    def __init__(self, job: Job, units: List[_ShardedUnit]) -> None:
        self.job = job
        self.lib = job._lib
        self.handle = job._handle
        self.units = units
        self.dtype: Optional[torch.dtype] = None
        # One NaN, broadcast to each parameter's shape while it is not bound.
        self.placeholder: Optional[torch.Tensor] = None
        self.backward_queued = False
        self.grad_flat: Dict[Tuple[int, int], torch.Tensor] = {}
        # Forward order of the units (first time each ran in this pass), so
        # that backward can ask for the unit it needs next before it hands
        # over the current unit's gradients.
        self.forward_order: List[_ShardedUnit] = []
        self.in_forward_order: set = set()
        # False under no_sync(): backward adds the gradients into the units'
        # gradient buffers and reduces nothing.
        self.sync = True
        self.optimizer: Optional["Optimizer"] = None  # the model's zerod optimizer

    # -- gathering and binding -------------------------------------------------

    def gather(self, unit: _ShardedUnit) -> None:
        view = _lib.sized(_lib.View)
        if unit.prefetch is not None:
            pending, unit.prefetch = unit.prefetch, None
            _check(self.lib.zd_gather_wait(self.handle, ctypes.byref(pending), ctypes.byref(view)),
                   "gather %s" % unit.name)
        else:
            _check(self.lib.zd_gather(self.handle, unit.zunit.id, ctypes.byref(view)),
                   "gather %s" % unit.name)
        _require_host(view, unit.name)
        address = int(view.base)
        if unit.flat is None:
            memory = (ctypes.c_char * int(view.bytes)).from_address(address)
            memory._zerod_owner = self.job.client
            dtype = _TORCH_DTYPES[int(view.dtype)]
            count = int(view.bytes) // torch.tensor([], dtype=dtype).element_size()
            unit.flat = torch.frombuffer(memory, dtype=dtype, count=count)
            unit.address = address
            unit.views = []
            for i, shape in enumerate(unit.shapes):
                t = unit.zunit.tensors[i]
                unit.views.append(unit.flat[t.offset:t.offset + t.numel].view(shape))
        elif address != unit.address:
            raise ShardingError(
                "unit %s came back at another address: attach the job with "
                "stable_addresses=True (the default of zerod.Client.attach)" % unit.name)

    def bind(self, unit: _ShardedUnit) -> None:
        for refs, param, view in zip(unit.refs, unit.params, unit.views):
            for ref in refs:
                if ref.module._parameters.get(ref.attr) is not param:
                    now = ref.module._parameters.get(ref.attr)
                    raise ShardingError(
                        "parameter %s was replaced after zerod.torch.shard (registered shape %s, "
                        "now %s); shard the model once its parameters are final" %
                        (ref.path, tuple(view.shape),
                         tuple(now.shape) if now is not None else None))
            data = param.data
            if data.data_ptr() not in (view.data_ptr(), self.placeholder.data_ptr()):
                raise ShardingError(
                    "parameter %s changed after zerod.torch.shard (registered shape %s, now %s); "
                    "its values live in zerod: change them with load_state_dict" %
                    (unit.names[unit.params.index(param)], tuple(view.shape), tuple(data.shape)))
            param.data = view

    def unbind(self, unit: _ShardedUnit) -> None:
        for param in unit.params:
            param.data = self.placeholder.expand(param.shape)

    def release(self, unit: _ShardedUnit) -> None:
        self.unbind(unit)
        _check(self.lib.zd_release(self.handle, unit.zunit.id), "release %s" % unit.name)

    # -- hooks -----------------------------------------------------------------

    def pre_forward(self, unit: _ShardedUnit) -> None:
        if torch.is_grad_enabled() and id(unit) not in self.in_forward_order:
            self.in_forward_order.add(id(unit))
            self.forward_order.append(unit)
        if unit.gathered == 0 and not unit.bwd_gathered:
            self.gather(unit)
            self.bind(unit)
        elif unit.gathered == 0:
            self.bind(unit)  # gathered for a backward still running
        unit.gathered += 1

    def post_forward(self, unit: _ShardedUnit, output: Any) -> None:
        unit.gathered -= 1
        if unit.gathered == 0 and not unit.bwd_gathered:
            self.release(unit)
        if torch.is_grad_enabled() and unit.grad_params:
            for tensor in _tensors_in(output):
                if tensor.requires_grad:
                    tensor.register_hook(lambda grad, unit=unit: self.pre_backward(unit))

    def pre_backward(self, unit: _ShardedUnit) -> None:
        if not self.backward_queued:
            self.backward_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self.finish_backward)
        if not unit.bwd_gathered:
            if unit.gathered == 0:
                self.gather(unit)
            self.bind(unit)
            unit.bwd_gathered = True
            self.prefetch_before(unit)

    def prefetch_before(self, unit: _ShardedUnit) -> None:
        """Sends the gather of the unit that ran just before `unit` in the
        forward pass (the next one backward needs), ahead of `unit`'s
        reduce: the daemon answers a rank's requests in order, so the
        gather is not queued behind that reduce (FSDP's backward prefetch)."""
        order = self.forward_order
        for i in range(len(order) - 1, 0, -1):
            if order[i] is unit:
                previous = order[i - 1]
                if previous.gathered == 0 and not previous.bwd_gathered and previous.prefetch is None:
                    pending = _lib.sized(_lib.Pending)
                    _check(self.lib.zd_gather_async(self.handle, previous.zunit.id,
                                                    ctypes.byref(pending)),
                           "gather %s" % previous.name)
                    previous.prefetch = pending
                return

    def grad_ready(self, unit: _ShardedUnit) -> None:
        unit.grads_ready += 1
        if unit.grads_ready == unit.grad_params:
            self.push(unit)

    def push(self, unit: _ShardedUnit) -> None:
        """Hands the unit's gradients to the daemon and releases it; under
        no_sync, adds them into its gradient buffer and reduces nothing."""
        view = _lib.sized(_lib.View)
        _check(self.lib.zd_grad_buffer(self.handle, unit.zunit.id, ctypes.byref(view)),
               "gradient buffer of %s" % unit.name)
        _require_host(view, unit.name)
        key = (int(view.base), int(view.bytes))
        flat = self.grad_flat.get(key)
        if flat is None:
            memory = (ctypes.c_char * key[1]).from_address(key[0])
            memory._zerod_owner = self.job.client
            dtype = _TORCH_DTYPES[int(view.dtype)]
            flat = torch.frombuffer(memory, dtype=dtype,
                                    count=key[1] // torch.tensor([], dtype=dtype).element_size())
            self.grad_flat[key] = flat
        with torch.no_grad():
            for i, param in enumerate(unit.params):
                if not param.requires_grad:
                    continue
                t = unit.zunit.tensors[i]
                dst = flat[t.offset:t.offset + t.numel]
                if param.grad is None:
                    if not unit.accumulated:
                        dst.zero_()
                elif unit.accumulated:
                    dst.add_(param.grad.reshape(-1))  # the order DDP's .grad sums in
                    param.grad = None
                else:
                    dst.copy_(param.grad.reshape(-1))
                    param.grad = None
        if self.sync:
            # One-way: backward goes on while the daemon reduces; the step
            # (or the unit's next gradient buffer) waits for it.
            _check(self.lib.zd_reduce_async(self.handle, unit.zunit.id), "reduce %s" % unit.name)
        unit.accumulated = not self.sync
        unit.grads_ready = 0
        if unit.bwd_gathered:
            unit.bwd_gathered = False
            if unit.gathered == 0:
                self.release(unit)

    def finish_backward(self) -> None:
        """End of a backward pass: units whose parameters did not all get a
        gradient (unused in this pass) are reduced with zeros for the rest,
        and every unit gathered for backward is released."""
        self.backward_queued = False
        self.forward_order = []
        self.in_forward_order = set()
        for unit in self.units:
            if unit.prefetch is not None:
                # Sent for a unit backward did not reach after all: take the
                # reply and give the unit back.
                self.gather(unit)
                self.release(unit)
            if unit.grads_ready > 0:
                self.push(unit)
            elif unit.bwd_gathered:
                unit.bwd_gathered = False
                if unit.gathered == 0:
                    self.release(unit)

    def pending(self) -> List[str]:
        return [u.name for u in self.units if u.bwd_gathered or u.grads_ready]

    def unreduced(self) -> List[str]:
        """Units whose gradient buffers hold no_sync micro-batches."""
        return [u.name for u in self.units if u.accumulated]


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

    def set_requires_gradient_sync(self, requires_gradient_sync: bool) -> None:
        """FSDP2's switch: False makes the backward passes that follow add
        their gradients into the units' gradient buffers (shared memory in
        the daemon's pool, counted in max_live_bytes) and reduce nothing;
        the first backward with True adds its own and reduces the sum."""
        self._zerod.sync = bool(requires_gradient_sync)

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
        by_param: Dict[int, torch.Tensor] = {}
        for key, value in local.items():
            if key in state_dict and isinstance(value, nn.Parameter):
                by_param.setdefault(id(value), state_dict[key])
        # Every rank checks (all pass the same dict), so a bad dict fails
        # everywhere before the first collective.
        for unit in state.units:
            for param, name, shape in zip(unit.params, unit.names, unit.shapes):
                value = by_param.get(id(param))
                if value is not None and tuple(value.shape) != tuple(shape):
                    raise RuntimeError("size mismatch for %s: copying a param with shape %s, "
                                       "the shape in the sharded model is %s" %
                                       (name, tuple(value.shape), tuple(shape)))
        # Parameters the dict leaves out (strict=False) keep their values.
        keep = any(id(p) not in by_param for unit in state.units for p in unit.params)
        current = self._full_values() if keep else {}
        for unit in state.units:
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


def shard(model: nn.Module, job: Job, units: UnitsPolicy = "per-module") -> ShardedModule:
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
    """
    if isinstance(model, ShardedModule):
        raise ShardingError("the model is already sharded")
    if not isinstance(job, Job):
        raise InvalidArgumentError("job must be a zerod.Job (from zerod.Client().attach)")
    plan = _plan(model, units)
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
        _check_layout(unit)


def _check_layout(unit: _ShardedUnit) -> None:
    tensors = unit.zunit.tensors
    if len(tensors) != len(unit.params):
        raise ShardingError("unit %s has %d tensors in zerod, %d in the model" %
                            (unit.name, len(tensors), len(unit.params)))
    for t, name, shape in zip(tensors, unit.names, unit.shapes):
        if t.name != name or tuple(t.shape) != tuple(shape):
            raise ShardingError("unit %s: zerod has %s %s where the model has %s %s" %
                                (unit.name, t.name, t.shape, name, tuple(shape)))


def _install_hooks(state: _State, unit: _ShardedUnit) -> None:
    module = unit.module
    module.register_forward_pre_hook(lambda mod, args, unit=unit: state.pre_forward(unit))
    module.register_forward_hook(
        lambda mod, args, output, unit=unit: state.post_forward(unit, output))
    unit.grad_params = 0
    for param in unit.params:
        if not param.requires_grad or state.job.read_only:
            continue
        unit.grad_params += 1
        # The AccumulateGrad node of the parameter: its hook runs once the
        # parameter's gradient for this backward pass is complete.
        accumulate = param.expand_as(param).grad_fn.next_functions[0][0]
        accumulate.register_hook(lambda *unused, unit=unit: state.grad_ready(unit))
        unit.grad_hooks.append(accumulate)


class Optimizer(torch.optim.Optimizer):
    """The optimizer of a sharded model: ``step()`` asks the daemon for its
    step (the algorithm and hyper-parameters are the job's, from
    :class:`zerod.JobConfig`).

    It behaves like torch's optimizers where it can: ``param_groups[0]["lr"]``
    is sent with every step, so torch's learning-rate schedulers work on it;
    ``clip_grad_norm_(max_norm)`` before ``step()`` (or
    ``torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)``, which
    zerod.torch routes here) returns the global norm, computed in the daemon
    over every rank's gradients, and clips that step by it. Gradients are
    averaged over the job's ranks, as DDP does. ``zero_grad()`` only clears local ``.grad``: the daemon starts
    every step's accumulation from zero itself.
    """

    _GROUP_KEYS = ("lr", "betas", "eps", "weight_decay", "momentum", "dampening", "nesterov")

    def __init__(self, model: ShardedModule, params: Any = None, lr: Optional[float] = None,
                 max_grad_norm: Optional[float] = None, **defaults: Any) -> None:
        if not isinstance(model, ShardedModule):
            raise InvalidArgumentError("zerod.torch.Optimizer takes the model zerod.torch.shard "
                                       "returned")
        job = model.job
        if job.read_only:
            raise ShardingError("a read-only job cannot step")
        config = job.config
        if lr is None:
            lr = config.lr if config is not None and config.lr else 1e-3
        if max_grad_norm is None and config is not None:
            max_grad_norm = config.max_grad_norm
        unknown = set(defaults) - set(self._GROUP_KEYS)
        if unknown:
            raise InvalidArgumentError("unknown optimizer options %s (zerod groups take %s)" %
                                       (sorted(unknown), ", ".join(self._GROUP_KEYS)))
        trainable = [p for p in model.parameters() if p.requires_grad]
        groups = self._groups_of(params, trainable)
        # Hyper-parameters of its own (groups, or keyword defaults such as
        # weight_decay=0.0) go to the daemon; without any the job's are used.
        self._grouped = len(groups) > 1 or bool(defaults) or any(
            set(g) - {"params"} for g in groups)
        super().__init__(groups, dict(lr=float(lr), **defaults))
        self._model = model
        self._job = job
        if self._grouped:
            self._send_groups()
        model._zerod.optimizer = self
        self._sent_lr: Optional[float] = None
        self._sent_group_lrs: Optional[List[float]] = None
        self._sent_norm: Optional[float] = None
        self._clip: Optional[float] = None
        self.max_grad_norm = max_grad_norm
        self.last_step: Optional[StepResult] = None

    @staticmethod
    def _groups_of(params: Any, trainable: List[nn.Parameter]) -> List[Dict[str, Any]]:
        """torch's param-group list (or a list of parameters, or None: all
        of them), checked: every trainable parameter of the model in exactly
        one group (zerod steps them all), nothing else."""
        if params is None:
            return [{"params": trainable}]
        params = list(params)
        groups = ([dict(g) for g in params] if params and isinstance(params[0], dict)
                  else [{"params": params}])
        known = {id(p) for p in trainable}
        seen: Dict[int, int] = {}
        for index, group in enumerate(groups):
            if "params" not in group:
                raise InvalidArgumentError("parameter group %d has no 'params'" % index)
            group["params"] = list(group["params"])
            for p in group["params"]:
                if id(p) not in known:
                    raise InvalidArgumentError("parameter group %d holds a tensor that is not a "
                                               "trainable parameter of the sharded model" % index)
                if id(p) in seen:
                    raise InvalidArgumentError("a parameter is in groups %d and %d" %
                                               (seen[id(p)], index))
                seen[id(p)] = index
        left = [p for p in trainable if id(p) not in seen]
        if left:
            raise InvalidArgumentError("%d trainable parameters are in no group: zerod steps every "
                                       "trainable parameter of the model" % len(left))
        return groups

    def _send_groups(self) -> None:
        """The groups' hyper-parameters and each tensor's group, to the
        daemon (SET_GROUPS: every rank sends the same)."""
        group_of = {id(p): g for g, group in enumerate(self.param_groups) for p in group["params"]}
        hparams = [{k: group[k] for k in self._GROUP_KEYS if k in group}
                   for group in self.param_groups]
        tensor_groups = {unit.zunit.id: [group_of.get(id(p), 0) for p in unit.params]
                         for unit in self._model._zerod.units}
        self._job.set_groups(hparams, tensor_groups)

    @property
    def loss_scale(self) -> float:
        """The dynamic loss scale of the next step (an fp16 job's, or one
        with JobConfig.loss_scale): multiply the loss by it before
        backward (:meth:`scale`); the daemon divides the gradients by it,
        skips a step whose gradients overflow and moves the scale as
        torch.amp.GradScaler does. 0.0: the job scales no loss."""
        return self._job.loss_scale

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """GradScaler.scale: the loss times the current loss scale (the
        loss itself when the job scales no loss)."""
        scale = self.loss_scale
        return loss * scale if scale > 0 else loss

    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        if getattr(self, "_job", None) is not None:
            raise ShardingError("zerod.torch.Optimizer takes its parameter groups when it is made "
                                "(every trainable parameter in one): pass them all to it")
        super().add_param_group(param_group)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0,
                        error_if_nonfinite: bool = False) -> torch.Tensor:
        """Clips the coming step's gradients to a global L2 norm of
        `max_norm` (torch.nn.utils.clip_grad_norm_'s rule, applied in the
        step) and returns the norm before clipping, which the daemon
        computes over every rank's gradients (a collective)."""
        if norm_type != 2.0:
            raise InvalidArgumentError("zerod clips by the L2 norm only")
        if not max_norm > 0:
            raise InvalidArgumentError("max_norm must be > 0")
        pending = self._model._zerod.pending()
        if pending:
            raise ShardingError("clip_grad_norm_ while units %s still wait for gradients" % pending)
        norm = self._job.grad_norm(grad_scale=float(self._job.world_size))
        if error_if_nonfinite and not math.isfinite(norm):
            raise RuntimeError("The total norm of order 2.0 for gradients from `parameters` is "
                               "non-finite, so it cannot be clipped")
        self._clip = float(max_norm)
        return torch.tensor(norm)

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        pending = self._model._zerod.pending()
        if pending:
            raise ShardingError("step() while units %s still wait for gradients" % pending)
        unreduced = self._model._zerod.unreduced()
        if unreduced:
            raise ShardingError(
                "step() with gradients of units %s accumulated under no_sync and not reduced: "
                "run the last micro-batch's backward outside no_sync (as with DDP)" % unreduced)
        lrs = [float(g["lr"]) for g in self.param_groups]
        norm = self._clip if self._clip is not None else self.max_grad_norm
        send_norm = None
        if norm is not None and norm != self._sent_norm:
            send_norm = norm
        elif norm is None and self._sent_norm is not None:
            send_norm = 0.0
        if self._grouped:
            group_lrs = lrs if lrs != self._sent_group_lrs else None
            result = self._job.step(group_lrs=group_lrs, max_grad_norm=send_norm,
                                    grad_scale=float(self._job.world_size))
            self._sent_group_lrs = lrs
        else:
            result = self._job.step(lr=lrs[0] if lrs[0] != self._sent_lr else None,
                                    max_grad_norm=send_norm,
                                    grad_scale=float(self._job.world_size))
            self._sent_lr = lrs[0]
        if send_norm is not None:
            self._sent_norm = send_norm
        self._clip = None
        self.last_step = result
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        for group in self.param_groups:
            for param in group["params"]:
                param.grad = None

    # -- state_dict --------------------------------------------------------------

    def _moments(self) -> List[str]:
        """torch's names of the per-parameter state the job's optimizer keeps."""
        config = self._job.effective_config
        if config.optimizer in ("adam", "adamw"):
            return ["exp_avg", "exp_avg_sq"]
        return ["momentum_buffer"] if config.momentum != 0 else []

    def _flat_params(self) -> List[nn.Parameter]:
        """The groups' parameters in torch.optim's numbering (group by group)."""
        return [p for group in self.param_groups for p in group["params"]]

    def _trainable(self) -> Iterator[Tuple[int, "_ShardedUnit", int, int, int]]:
        """(torch.optim's index of the parameter, unit, tensor index, offset
        in the unit's packed values, numel) of every trainable parameter."""
        index_of = {id(p): i for i, p in enumerate(self._flat_params())}
        for unit in self._model._zerod.units:
            at = 0
            for k, (param, t) in enumerate(zip(unit.params, unit.zunit.tensors)):
                if id(param) in index_of:
                    yield index_of[id(param)], unit, k, at, t.numel
                at += t.numel

    def state_dict(self) -> Dict[str, Any]:
        """torch.optim's format: ``{"state": {index: {"step": tensor(n.),
        "exp_avg": ..., "exp_avg_sq": ...}}, "param_groups": [{"lr": ...,
        "params": [indices]}]}`` (SGD: ``"momentum_buffer"``), the daemon's
        fp32 moments gathered whole. Where the working copy is not fp32 each
        entry also has ``"master"``: the fp32 weights, which the model's
        state_dict rounds. A collective: every rank calls it."""
        names = self._moments()
        master = self._model._zerod.dtype != torch.float32
        read: Dict[Tuple[int, str], Tuple[np.ndarray, int]] = {}
        step = 0
        for unit in self._model._zerod.units:
            for name in names + (["weights"] if master else []):
                values, step = unit.zunit.read_state(name)
                read[(id(unit), name)] = (values, step)
        state: Dict[int, Dict[str, Any]] = {}
        for index, unit, k, at, numel in self._trainable():
            shape = unit.shapes[k]
            entry: Dict[str, Any] = {"step": torch.tensor(float(step))}
            for name in names + (["master"] if master else []):
                values = read[(id(unit), "weights" if name == "master" else name)][0]
                entry[name] = torch.from_numpy(values[at:at + numel].copy()).view(shape)
            state[index] = entry
        config = self._job.effective_config
        job_values: Dict[str, Any] = dict(betas=config.betas, eps=config.eps,
                                          weight_decay=config.weight_decay)
        if config.optimizer == "sgd":
            job_values.update(momentum=config.momentum, dampening=config.dampening,
                              nesterov=config.nesterov)
        groups, first = [], 0
        for g in self.param_groups:
            group = dict(job_values)
            group.update({k: v for k, v in g.items() if k != "params"})
            group["params"] = list(range(first, first + len(g["params"])))
            first += len(g["params"])
            groups.append(group)
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Loads what state_dict returned (or torch.optim's AdamW/Adam/SGD
        state for the same parameters, in the same order): the moments and
        the step count go to the daemon, the group's lr to this optimizer,
        "master" (if present) to the fp32 weights. Checked whole on every
        rank before the first collective; every rank must pass the same."""
        groups = state_dict.get("param_groups")
        if not isinstance(groups, list) or len(groups) != len(self.param_groups):
            raise ShardingError("the state has %s parameter groups, this optimizer %d" %
                                (len(groups) if isinstance(groups, list) else "no",
                                 len(self.param_groups)))
        for g, (saved, ours) in enumerate(zip(groups, self.param_groups)):
            if len(saved.get("params", [])) != len(ours["params"]):
                raise ShardingError("the state's group %d has %d parameters, this optimizer's %d" %
                                    (g, len(saved.get("params", [])), len(ours["params"])))
        position = {saved: i for i, saved in
                    enumerate(p for group in groups for p in group["params"])}
        saved_state = {position[k]: v for k, v in state_dict.get("state", {}).items()
                       if k in position}
        names = self._moments()
        steps = {float(entry["step"]) for entry in saved_state.values() if "step" in entry}
        if len(steps) > 1:
            raise ShardingError("the state's parameters were stepped %s times: a zerod job "
                                "steps all its parameters together" % sorted(steps))
        step = int(steps.pop()) if steps else None
        packed: Dict[Tuple[int, str], np.ndarray] = {}
        for index, unit, k, at, numel in self._trainable():
            entry = saved_state.get(index, {})
            for name in names + ["master"]:
                if name not in entry:
                    continue
                value = entry[name]
                if tuple(value.shape) != tuple(unit.shapes[k]):
                    raise ShardingError("%s of %s has shape %s, the parameter %s" %
                                        (name, unit.names[k], tuple(value.shape),
                                         tuple(unit.shapes[k])))
                key = (id(unit), name)
                if key not in packed:
                    packed[key] = np.zeros(unit.zunit.numel_packed, dtype=np.float32)
                packed[key][at:at + numel] = value.detach().float().reshape(-1).numpy()
        for unit in self._model._zerod.units:
            if (id(unit), "master") in packed:
                unit.zunit.load(packed[(id(unit), "master")])
            for name in names:
                if (id(unit), name) in packed or step is not None:
                    values = packed.get((id(unit), name))
                    if values is None:
                        values = np.zeros(unit.zunit.numel_packed, dtype=np.float32)
                    unit.zunit.load(values, state=name, step=step)
        for saved, ours in zip(groups, self.param_groups):
            if "lr" in saved:
                ours["lr"] = float(saved["lr"])


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


# torch.nn.utils.clip_grad_norm_ for sharded models. Their gradients are in
# the daemon by the time a training loop clips (each unit's go there as soon
# as its backward is done), so torch's own function would find no .grad and
# return 0 without clipping anything. zerod.torch replaces it with one that
# hands sharded parameters to their model's optimizer (the daemon computes
# the norm over every rank's gradients and the step clips) and passes any
# other call to torch's.
_torch_clip_grad_norm_ = torch.nn.utils.clip_grad_norm_


def clip_grad_norm_(parameters: Any, max_norm: float, norm_type: float = 2.0,
                    *args: Any, **kwargs: Any) -> torch.Tensor:
    """torch.nn.utils.clip_grad_norm_, which zerod.torch installs in its
    place: for the parameters of a sharded model (all of them, as
    ``model.parameters()`` gives them) the daemon computes the global norm
    and the next step clips; other parameters go to torch's function."""
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
    if state.optimizer is None:
        raise ShardingError("clip_grad_norm_ on a sharded model needs its zerod.torch.Optimizer "
                            "(made before the first backward)")
    error_if_nonfinite = kwargs.get("error_if_nonfinite", args[0] if args else False)
    return state.optimizer.clip_grad_norm_(max_norm, float(norm_type),
                                           error_if_nonfinite=bool(error_if_nonfinite))


torch.nn.utils.clip_grad_norm_ = clip_grad_norm_
