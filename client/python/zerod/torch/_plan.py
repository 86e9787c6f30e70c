"""The sharding plan: which module's parameters make each unit, and where
each parameter is held (shared modules, tied weights)."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Callable, Iterator, List, Optional, Sequence, Tuple, Union

import torch
from torch import nn

from .. import _lib
from ..client import Unit
from ..errors import InvalidArgumentError, ShardingError

UnitsPolicy = Union[str, Sequence[type], Callable[[nn.Module, str], bool]]
BaseNames = Callable[[str], str]

# The job's own part of a unit module whose frozen parameters come from the
# base is a unit of this name: the module's path and this suffix.
OWN_SUFFIX = "#own"


def base_name(name: str) -> str:
    """The name a parameter (or module path) of a LoRA model has in the
    plain model that made the base: peft's wrapping dropped (a leading
    ``base_model.model.`` and every ``base_layer`` component), other names
    unchanged (zerod.torch.lora.LoRALinear keeps its layer's names)."""
    parts = name.split(".") if name else []
    if parts[:2] == ["base_model", "model"]:
        parts = parts[2:]
    return ".".join(p for p in parts if p != "base_layer")


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
        # A reference to the job's base's unit of this name (frozen, never a
        # gradient): shard(..., base=...).
        self.from_base = False


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


def _split_base(units: List[_ShardedUnit], names: BaseNames) -> List[_ShardedUnit]:
    """Splits each unit into the base's part and the job's (a unit is wholly
    the base's or wholly the job's): the frozen parameters (requires_grad
    False) become a unit referring to the base, named (unit and tensors) as
    the plain model that made the base names them (`names`); the trainable
    ones stay the job's, in a unit of the module's path, with OWN_SUFFIX
    when the module also has a base part. Both parts hook the same module."""
    out: List[_ShardedUnit] = []
    for unit in units:
        frozen = [i for i, p in enumerate(unit.params) if not p.requires_grad]
        own = [i for i, p in enumerate(unit.params) if p.requires_grad]
        path = "" if unit.name == "<root>" else unit.name
        parts = []
        if frozen:
            parts.append((frozen, names(path) or "<root>", True))
        if own:
            parts.append((own, unit.name + OWN_SUFFIX if frozen else unit.name, False))
        for indices, name, from_base in parts:
            part = _ShardedUnit(len(out), name, unit.module)
            part.from_base = from_base
            for i in indices:
                part.params.append(unit.params[i])
                part.names.append(names(unit.names[i]) if from_base else unit.names[i])
                part.refs.append(unit.refs[i])
                part.shapes.append(unit.shapes[i])
            out.append(part)
    seen = set()
    for unit in out:
        if unit.name in seen:
            raise ShardingError("two units of the model are named %s once their names are "
                                "mapped to the base's: choose units so that each base unit "
                                "comes from one module" % unit.name)
        seen.add(unit.name)
    return out
