"""Optimizer: the daemon's step for a sharded model, with torch.optim's
surface (parameter groups, learning-rate schedulers, clipping, loss
scaling, state_dict)."""

from __future__ import annotations

import math
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import numpy as np
import torch
from torch import nn

from ..client import Job, StepResult
from ..errors import InvalidArgumentError, ShardingError
from ._module import ShardedModule
from ._plan import _ShardedUnit

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

    def _rebind(self, job: Job) -> None:
        """The model's job was attached again (ShardedModule.recover): what
        was sent to the old attachment is sent again."""
        self._job = job
        self._sent_lr = self._sent_group_lrs = self._sent_norm = None
        self._clip = None
        if self._grouped:
            self._send_groups()

    def _send_groups(self) -> None:
        """The groups' hyper-parameters and each tensor's group, to the
        daemon (SET_GROUPS: every rank sends the same)."""
        group_of = {id(p): g for g, group in enumerate(self.param_groups) for p in group["params"]}
        hparams = [{k: group[k] for k in self._GROUP_KEYS if k in group}
                   for group in self.param_groups]
        tensor_groups = {unit.zunit.id: [group_of.get(id(p), 0) for p in unit.params]
                         for unit in self._model._zerod.units if not unit.from_base}
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
            if unit.from_base:
                continue  # no optimizer state: the base's units are never stepped
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
            if unit.from_base:
                continue
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
