"""The hooks' state of a sharded model: gathering and binding units around
their forward, gathering again for backward (with a prefetch of the next),
and handing each unit's gradients to the daemon once they are complete."""

from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING, Any, Dict, Iterator, List, Optional, Tuple

import torch

from .. import _lib
from ..client import Job, _check
from ..errors import ShardingError
from ._plan import _ShardedUnit

if TYPE_CHECKING:
    from ._optim import Optimizer

_TORCH_DTYPES = {_lib.F32: torch.float32, _lib.BF16: torch.bfloat16, _lib.F16: torch.float16}


def _require_host(view: _lib.View, unit_name: str) -> None:
    """zerod.torch wraps shared memory only: a GPU buffer (zerod --device
    cuda) holds a device pointer that must never be read as host memory."""
    if int(view.device) >= 0:
        raise ShardingError(
            "unit %s: zerod keeps this job on GPU %d (zerod --device cuda); zerod.torch "
            "supports daemons with --device cpu only" % (unit_name, int(view.device)))


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

    def rebind(self, job: Job) -> None:
        """Takes `job` (the same job attached again after it was rebuilt)
        in place of the old attachment: nothing gathered, pending or
        accumulated is kept, every parameter shows its placeholder."""
        self.job = job
        self.lib = job._lib
        self.handle = job._handle
        self.backward_queued = False
        self.grad_flat = {}
        self.forward_order = []
        self.in_forward_order = set()
        for unit in self.units:
            unit.flat, unit.address, unit.views = None, 0, []
            unit.gathered, unit.bwd_gathered, unit.prefetch = 0, False, None
            unit.grads_ready, unit.accumulated = 0, False
            for param in unit.params:
                param.grad = None
            self.unbind(unit)

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
        # A unit with no trainable parameter (frozen layers, a base's units)
        # is gathered for backward too when gradients flow through it: the
        # tensors autograd saved (its weights) are read there. It has no
        # gradient to hand over, so it stays gathered until the end of the
        # backward pass.
        if torch.is_grad_enabled():
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
        # A unit that also holds frozen parameters stays gathered until the
        # end of the pass: the backward of its module may still read them
        # (a frozen weight's input gradient, after the adapters' gradients).
        if unit.bwd_gathered and unit.grad_params == len(unit.params):
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
            if unit.bwd_gathered:
                unit.bwd_gathered = False
                if unit.gathered == 0:
                    self.release(unit)

    def pending(self) -> List[str]:
        return [u.name for u in self.units if u.bwd_gathered or u.grads_ready]

    def unreduced(self) -> List[str]:
        """Units whose gradient buffers hold no_sync micro-batches."""
        return [u.name for u in self.units if u.accumulated]


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
