"""The zerod client: connections, jobs, units and their shared buffers.

This is a thin layer over libzerod (ctypes, no compiled extension). A
gathered unit is the daemon's shared-memory buffer mapped into this process:
:meth:`Gathered.array` and :meth:`Gathered.tensors` are views of it, not
copies. Their values are valid until the unit is released (gathered) or
reduced (gradient); after that the memory may be unmapped or made
inaccessible, so copy what must outlive the release."""

from __future__ import annotations

import ctypes
import os
import warnings
from dataclasses import dataclass
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple, Union

import numpy as np

from . import _lib, _lifetime, _recover, _subscribe, _token
from ._subscribe import Subscription, Update
from .errors import BY_STATUS, Error, InvalidArgumentError
from ._config import _DTYPE_NAMES, JobConfig

# numpy has no bfloat16: its values are shown as their raw 16-bit patterns.
_NUMPY_DTYPES = {_lib.F32: np.float32, _lib.BF16: np.uint16, _lib.F16: np.float16}
_INITS = {"rank0": _lib.INIT_FROM_RANK0, "normal": _lib.INIT_SEEDED_NORMAL, "zeros": _lib.INIT_ZEROS}


def _raise(status: int, what: str) -> None:
    lib = _lib.load()
    detail = (lib.zd_last_error() or b"").decode("utf-8", "replace")
    name = (lib.zd_strerror(status) or b"").decode()
    message = detail if detail else "%s: %s" % (what, name)
    raise BY_STATUS.get(status, Error)(message, status)


def _check(status: int, what: str) -> None:
    if status != 0:
        _raise(status, what)


def default_socket() -> str:
    """``$ZEROD_SOCKET``, else the local daemon's socket in its default
    state directory (the user's, ``/var/lib/zerod`` or ``/run/zerod``:
    the first that exists)."""
    return _lib.load().zd_default_socket().decode()


@dataclass(frozen=True)
class StepResult:
    """What an optimizer step did: the step number (from 1), the job's new
    version, the global gradient norm before clipping, and whether the step
    was skipped for Inf/NaN gradients."""

    step: int
    version: int
    grad_norm: float
    skipped: bool
    loss_scale: float = 0.0  # for the next step's loss; 0: no loss scaling


@dataclass(frozen=True)
class CheckpointInfo:
    """A service checkpoint a job's workers saved or restored: its name,
    the step it holds (restored: the job's step now), the longest time a
    rank held training to copy its state out (saves) and the call's time."""

    name: str
    step: int
    stall_ms: int
    total_ms: int

    @classmethod
    def _from_c(cls, c: _lib.CheckpointInfo) -> "CheckpointInfo":
        return cls(name=c.name.decode(), step=int(c.step), stall_ms=int(c.stall_ms),
                   total_ms=int(c.total_ms))


@dataclass(frozen=True)
class TensorInfo:
    """A tensor's place in its unit's flat buffer (offset in elements)."""

    name: str
    shape: Tuple[int, ...]
    offset: int
    numel: int


TensorSpec = Union[Tuple[str, Sequence[int]], Tuple[str, Sequence[int], bool]]


def _env_int(name: str) -> Optional[int]:
    """A launcher's integer variable (torchrun's LOCAL_RANK, RANK,
    WORLD_SIZE), None when unset."""
    text = os.environ.get(name)
    if text is None or text.strip() == "":
        return None
    try:
        value = int(text)
    except ValueError:
        raise InvalidArgumentError("%s=%r is not an integer" % (name, text)) from None
    if value < 0:
        raise InvalidArgumentError("%s=%d is negative" % (name, value))
    return value


_STATES = {"weights": 0, "exp_avg": 1, "momentum_buffer": 1, "exp_avg_sq": 2}


def _state_code(state: str, what: str) -> int:
    if state not in _STATES:
        raise InvalidArgumentError("%s: state must be one of %s, not %r" %
                                   (what, ", ".join(_STATES), state))
    return _STATES[state]


def _pack(values: Union[np.ndarray, Sequence[np.ndarray]], expected: int, what: str) -> np.ndarray:
    """Tensor values as one contiguous float32 array of `expected` elements."""
    if isinstance(values, np.ndarray):
        packed = np.ascontiguousarray(values, dtype=np.float32).reshape(-1)
    else:
        packed = np.concatenate([np.asarray(v, dtype=np.float32).reshape(-1) for v in values])
    if packed.size != expected:
        raise InvalidArgumentError("%s: %d values for %d elements" % (what, packed.size, expected))
    return packed


def _memory(address: int, nbytes: int, owner: Any) -> ctypes.Array:
    """A ctypes byte array over mapped memory that keeps `owner` alive."""
    array = (ctypes.c_char * nbytes).from_address(address)
    array._zerod_owner = owner  # the mapping lives as long as the client
    return array


class Client:
    """A connection to the node's zerod daemon (its Unix socket).

    ``Client()`` uses :func:`default_socket`. Raises
    :class:`zerod.UnavailableError` when no daemon listens there.
    """

    def __init__(self, socket: Union[str, os.PathLike, None] = None) -> None:
        self._lib = _lib.load()
        self._handle: Optional[int] = None
        self.socket = os.fspath(socket) if socket is not None else default_socket()
        self._defaulted = socket is None  # libzerod says where it looked
        self._jobs: List[Job] = []
        self._connect()
        _lifetime.track(self)

    def attach(self, job: str, *, rank: Optional[int] = None, token: Optional[str] = None,
               create: Union[bool, str] = True, world_size: Optional[int] = None,
               config: Optional[JobConfig] = None, read_only: bool = False, pin: bool = True,
               stable_addresses: bool = True) -> "Job":
        """Attaches to `job` as local `rank` (one job per client).

        `rank` is the rank's index on this daemon; None takes torchrun's
        ``LOCAL_RANK`` (0 when unset). A launcher's ``WORLD_SIZE`` must be the
        job's world size (else InvalidArgumentError, naming both); a ``RANK``
        other than the job's global rank for this local rank only warns: the
        nodes' placement decides global ranks, so shard data by ``Job.rank``.

        With ``create`` (True) a missing job is created with `config` and
        ``world_size`` ranks (None: the launcher's ``WORLD_SIZE``, else the
        daemon's ``--ranks``); a job that exists is resumed and keeps its
        own config, and if `config` differs from it the daemon says so
        (``Job.attach_warning``, also issued as a ``UserWarning``).
        ``create=False`` attaches only to a job that exists;
        ``create="fresh"`` refuses a job that has done a step
        (zerod/_lifetime.py). Local rank 0 prints which step it starts at.
        A read-only attachment (``read_only=True``) takes no rank and cannot
        change the job; with ``pin`` all its gathers come from one version,
        pinned now and moved by :meth:`Job.pin`. ``stable_addresses`` (the
        default here, unlike the C library's) keeps each unit's gathered view
        at one address, which zerod.torch needs; it costs an mmap per gather.
        `token` None takes ``$ZEROD_TOKEN`` (unset: none); ``""`` is none.
        """
        self._require_open("attach")
        if rank is None:
            rank = 0 if read_only else (_env_int("LOCAL_RANK") or 0)
        options = _lib.sized(_lib.AttachOptions)
        options.job = job.encode()
        options.local_rank = int(rank)
        options.token = _token.encode(token)
        options.read_only = int(read_only)
        options.create = _lifetime.create_mode(create, read_only)
        options.world_size = _lifetime.world_size_to_ask(world_size, _env_int("WORLD_SIZE"))
        c_config = config._to_c() if config is not None else None
        if c_config is not None:
            options.config = ctypes.pointer(c_config)
        options.pin = int(pin)
        options.stable_addresses = int(stable_addresses)
        handle = ctypes.c_void_p()
        _check(self._lib.zd_attach(self._handle, ctypes.byref(options), ctypes.byref(handle)),
               "attach to job %s" % job)
        attached = Job(self, handle.value, job, config)
        attached._attach_args = {"rank": int(rank), "token": token, "read_only": read_only,
                                 "pin": pin, "stable_addresses": stable_addresses}
        self._jobs.append(attached)
        if attached.attach_warning is not None:
            warnings.warn(attached.attach_warning, stacklevel=2)
        if not read_only:
            self._check_launcher(attached)
        _lifetime.announce(attached, int(rank), read_only)
        return attached

    def _check_launcher(self, job: "Job") -> None:
        """torchrun's WORLD_SIZE and RANK against the job's."""
        try:
            world, global_rank = _env_int("WORLD_SIZE"), _env_int("RANK")
        except InvalidArgumentError:
            job.detach()
            raise
        if world is not None and world != job.world_size:
            job.detach()
            raise InvalidArgumentError(
                "the launcher's WORLD_SIZE is %d but job %s has %d ranks: start as many "
                "workers as the job has ranks" % (world, job.name, job.world_size))
        if global_rank is not None and global_rank != job.rank:
            warnings.warn("the launcher's RANK is %d but this worker is rank %d of job %s "
                          "(the job's placement decides global ranks): shard data by "
                          "Job.rank" % (global_rank, job.rank, job.name), stacklevel=3)

    def subscribe(self, job: str, *, token: Optional[str] = None,
                  timeout_s: Optional[float] = None) -> Subscription:
        """Follows an existing job's versions from a read-only attachment of
        its own: iterate over the returned :class:`Subscription` for each
        new version as an :class:`Update` (docs/subscribe.md). A wait longer
        than `timeout_s` ends the iteration (None: wait forever)."""
        return Subscription(self, job, token=token, timeout_s=timeout_s)

    def reattach(self, job: "Job", timeout_s: float = 300.0) -> "Job":
        """Attaches to `job` again, as it was attached (its name, local rank,
        token, read-only and pin choices), after it failed under this
        worker because it was rebuilt: a node lost, the job moved
        (``zerodctl jobs scale``) or restored, its ranks failed
        (docs/redundancy.md). Detaches `job`, then tries until `timeout_s`
        while the daemon answers that the job is being recovered
        (:class:`UnavailableError`), is not here yet (:class:`NotFoundError`)
        or failed again (:class:`AbortedError`), connecting again if the
        connection went. Returns the new :class:`Job`: its units are the
        recovered job's, ``job.stats()[0]["step"]`` the step to go on from
        (re-register nothing). Views of `job`'s gathered buffers must not be
        used afterwards."""
        return _recover.reattach(self, job, timeout_s)

    def _connect(self) -> None:
        handle = ctypes.c_void_p()
        path = None if self._defaulted else self.socket.encode()
        _check(self._lib.zd_connect(path, ctypes.byref(handle)),
               "connect to %s" % self.socket)
        self._handle = handle.value
        self._jobs = []

    def close(self) -> None:
        """Detaches every job and closes the connection. Views of gathered
        buffers must not be used afterwards."""
        if self._handle is not None:
            self._lib.zd_close(self._handle)
            self._handle = None

    def _require_open(self, what: str) -> None:
        if self._handle is None:
            raise Error("%s: the client is closed" % what)

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass


class Job:
    """An attached job: register or list its units, gather them, reduce
    gradients, step. Created by :meth:`Client.attach`."""

    def __init__(self, client: Client, handle: int, name: str, config: Optional[JobConfig]) -> None:
        self.client = client
        self._lib = client._lib
        self._handle = handle
        self.name = name
        self.config = config
        self.rank: int = self._lib.zd_job_rank(handle)
        self.world_size: int = self._lib.zd_job_world_size(handle)
        self.read_only: bool = bool(self._lib.zd_job_read_only(handle))
        warning = self._lib.zd_job_attach_warning(handle)
        # The daemon's word that `config` was not used (the job existed with
        # another one); None if it had nothing to say.
        self.attach_warning: Optional[str] = (warning.decode("utf-8", "replace")
                                              if warning else None)
        self._units: Dict[int, Unit] = {}
        self._refresh_units()

    @property
    def loss_scale(self) -> float:
        """What the next step's loss is to be multiplied by (dynamic loss
        scaling, JobConfig.loss_scale); 0.0 when the job scales no loss."""
        return float(self._lib.zd_job_loss_scale(self._handle))

    @property
    def effective_config(self) -> JobConfig:
        """The job's config as the daemon runs it (every default filled in;
        `config` is what this attach asked for)."""
        c = _lib.sized(_lib.JobConfig)
        _check(self._lib.zd_job_effective_config(self._handle, ctypes.byref(c)), "job config")
        return JobConfig._from_c(c)

    @property
    def version(self) -> int:
        """Completed steps (read-only pinned jobs: the pinned version)."""
        return int(self._lib.zd_job_version(self._handle))

    def _refresh_units(self) -> None:
        count = self._lib.zd_job_unit_count(self._handle)
        for index in range(count):
            info = _lib.sized(_lib.UnitInfo)
            _check(self._lib.zd_job_unit_info(self._handle, index, ctypes.byref(info)),
                   "unit info")
            if info.unit not in self._units:
                self._units[info.unit] = Unit(self, info)

    def register(self, name: str, tensors: Iterable[TensorSpec], *, init: str = "rank0",
                 values: Union[np.ndarray, Sequence[np.ndarray], None] = None, seed: int = 0,
                 std: float = 0.02, from_base: bool = False) -> "Unit":
        """Registers a unit (collective: every rank registers the same units
        in the same order). `tensors` are ``(name, shape)`` or ``(name,
        shape, frozen)``. With ``init="rank0"`` rank 0 passes `values`: the
        tensors' values in order (one float32 array packed, or one array per
        tensor); other ranks may pass None. ``"normal"`` draws N(0, std^2)
        from `seed`; ``"zeros"`` starts at zero.

        ``from_base=True`` (a job whose config names a ``base_job``) makes
        the unit a reference to the base's unit of this `name`: `tensors`
        must be the base's (names, shapes, frozen flags; a mismatch is
        InvalidArgumentError naming the unit and the field), `init` and
        `values` are ignored and nothing is sent. The unit is frozen and
        read-only (``Unit.from_base``): its gathers come from the node's
        shared base cache, and gradient buffers, reduces and loads of it
        are FailedPreconditionError."""
        if init not in _INITS:
            raise InvalidArgumentError("init must be one of %s, not %r" % (sorted(_INITS), init))
        specs = [tuple(t) for t in tensors]
        keep: List[Any] = []
        descs = _lib.sized_array(_lib.TensorDesc, len(specs))
        total = 0
        for i, spec in enumerate(specs):
            if len(spec) not in (2, 3):
                raise InvalidArgumentError("tensor spec %r: expected (name, shape[, frozen])" % (spec,))
            shape = [int(d) for d in spec[1]]
            dims = (ctypes.c_uint64 * max(len(shape), 1))(*shape)
            keep.append(dims)
            descs[i].name = str(spec[0]).encode()
            descs[i].shape = dims
            descs[i].ndim = len(shape)
            descs[i].frozen = int(bool(spec[2])) if len(spec) == 3 else 0
            total += int(np.prod(shape, dtype=np.int64)) if shape else 1
        desc = _lib.sized(_lib.UnitDesc)
        desc.name = name.encode()
        desc.tensors = descs
        desc.ntensors = len(specs)
        desc.init = _INITS[init]
        desc.seed = int(seed)
        desc.init_std = float(std)
        desc.from_base = int(bool(from_base))
        packed = None
        if init == "rank0" and values is not None and not from_base:
            packed = _pack(values, total, "unit %s: initial values" % name)
            desc.init_values = packed.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
        unit_id = ctypes.c_uint32()
        _check(self._lib.zd_register_unit(self._handle, ctypes.byref(desc), ctypes.byref(unit_id)),
               "register unit %s" % name)
        self._refresh_units()
        unit = self._units[unit_id.value]
        unit.from_base = bool(from_base)
        return unit

    def list_units(self) -> List["Unit"]:
        """Fetches the job's unit table from the daemon (read-only jobs
        gather the units it lists) and returns every known unit."""
        count = ctypes.c_uint()
        _check(self._lib.zd_list_units(self._handle, ctypes.byref(count)), "list units")
        self._refresh_units()
        return self.units

    @property
    def units(self) -> List["Unit"]:
        """Known units (registered or listed), in id order."""
        return [self._units[k] for k in sorted(self._units)]

    def unit(self, name: str) -> "Unit":
        for unit in self._units.values():
            if unit.name == name:
                return unit
        raise InvalidArgumentError("job %s has no unit named %r (known: %s)" %
                                   (self.name, name, ", ".join(u.name for u in self.units)))

    def stats(self) -> List[Dict[str, Any]]:
        """What the collectives of the job's ranks on this daemon moved
        since the job was created there, one dict per rank in rank order:
        ``{"rank": 0, "step": 12, "counters": {("node", "all_gather"):
        {"bytes": ..., "calls": ...}, ...}, "pool_bytes": ...,
        "secondary_bytes": ..., "state_bytes": ..., "tier_bytes": ...,
        "host_state_bytes": ..., "comm_seconds": ..., "wait_seconds": ...,
        "exposed_comm_seconds": ...}``
        (levels "node", "cross" and "world"; only non-zero counters; the
        rank's buffer pool and the hpZ secondary partitions in it, and its
        shards' bytes in memory and in its tier file (offload_optimizer
        nvme), and a GPU rank's in host memory (offload_optimizer cpu),
        after its last request; and the seconds the rank spent in
        collectives, its worker waited for the daemon, and of those waits
        were communication (docs/daemon.md, "Exposed communication"))."""
        entries = (_lib.RankStats * 64)()
        entries[0].struct_size = ctypes.sizeof(_lib.RankStats)
        count = ctypes.c_uint()
        _check(self._lib.zd_job_stats(self._handle, entries, 64, ctypes.byref(count)), "stats")
        result = []
        for entry in entries[:min(count.value, 64)]:
            counters = {}
            for c in entry.counters[:entry.ncounters]:
                counters[(c.level.decode(), c.collective.decode())] = {
                    "bytes": int(c.bytes), "calls": int(c.calls)}
            result.append({"rank": int(entry.rank), "step": int(entry.step),
                           "counters": counters, "pool_bytes": int(entry.pool_bytes),
                           "secondary_bytes": int(entry.secondary_bytes),
                           "state_bytes": int(entry.state_bytes),
                           "tier_bytes": int(entry.tier_bytes),
                           "host_state_bytes": int(entry.host_state_bytes),
                           "comm_seconds": float(entry.comm_seconds),
                           "wait_seconds": float(entry.wait_seconds),
                           "exposed_comm_seconds": float(entry.exposed_comm_seconds)})
        return result

    def pin(self) -> int:
        """Read-only jobs: pins the latest version for the gathers that
        follow and returns it."""
        version = ctypes.c_uint64()
        _check(self._lib.zd_pin(self._handle, ctypes.byref(version)), "pin")
        return int(version.value)

    def watch(self, after: Optional[int] = None,
              timeout_s: Optional[float] = None) -> Optional[Update]:
        """Read-only jobs (subscribers, docs/subscribe.md): waits at most
        `timeout_s` (None: not at all) for a version newer than `after`
        (the one held; None: none, answered at once), pins the latest and
        returns it as an :class:`Update` naming the units to read; None
        when it timed out."""
        update = _lib.sized(_lib.Update)
        held = _subscribe.NO_VERSION if after is None else int(after)
        _check(self._lib.zd_watch(self._handle, held, _subscribe.timeout_ms(timeout_s),
                                  ctypes.byref(update)), "watch")
        return _subscribe.update_of(self, update)

    def grad_norm(self, grad_scale: Optional[float] = None) -> float:
        """The global L2 norm of the gradients reduced since the last step,
        divided by `grad_scale` (and the loss scale) as the next step will
        divide them. Collective over the job's ranks."""
        norm = ctypes.c_double()
        _check(self._lib.zd_grad_norm(self._handle, float(grad_scale or 0.0), ctypes.byref(norm)),
               "grad_norm")
        return float(norm.value)

    def save_checkpoint(self, name: Optional[str] = None) -> CheckpointInfo:
        """Saves the job as a service checkpoint (every rank's shard of the
        master weights and optimizer state, in the daemon's checkpoint
        directory), as `zerodctl checkpoint save` would. A collective, like
        torch.distributed.checkpoint.save: every rank calls it between the
        same two steps with the same name (None: ``step-<step>``); each
        returns once the checkpoint is durable."""
        info = _lib.sized(_lib.CheckpointInfo)
        _check(self._lib.zd_checkpoint_save(self._handle, (name or "").encode(),
                                            ctypes.byref(info)), "checkpoint save")
        return CheckpointInfo._from_c(info)

    def restore_checkpoint(self, name: str) -> CheckpointInfo:
        """Restores the job from its checkpoint `name`: master weights,
        optimizer state and step (parameter groups and the loss scale stay).
        A collective like save_checkpoint; units this worker held gathered
        are released. On failure the job keeps its state."""
        info = _lib.sized(_lib.CheckpointInfo)
        _check(self._lib.zd_checkpoint_restore(self._handle, name.encode(), ctypes.byref(info)),
               "checkpoint restore")
        return CheckpointInfo._from_c(info)

    def set_groups(self, groups: Sequence[Dict[str, Any]],
                   tensor_groups: Dict[int, Sequence[int]]) -> None:
        """Parameter groups, as torch.optim has them: `groups` are dicts of
        hyper-parameters (``lr``, ``betas``, ``eps``, ``weight_decay``,
        ``momentum``, ``dampening``, ``nesterov``; missing keys take the
        job's), `tensor_groups` maps a unit id to each of its tensors' group
        (units left out: group 0). Every rank must send the same: the ranks'
        requests are compared before anything changes, and groups that
        differ raise InvalidArgumentError on every rank, naming the field
        (``groups[1].lr``, ``ngroups``, ``tensor_groups``)."""
        c_groups = _lib.sized_array(_lib.ParamGroup, max(len(groups), 1))
        for c, g in zip(c_groups, groups):
            unknown = set(g) - {"lr", "betas", "eps", "weight_decay", "momentum", "dampening",
                                "nesterov"}
            if unknown:
                raise InvalidArgumentError("set groups: unknown keys %s" % sorted(unknown))
            c.lr = float(g.get("lr", 0.0))
            c.beta1, c.beta2 = (float(b) for b in g.get("betas", (0.0, 0.0)))
            c.eps = float(g.get("eps", 0.0))
            if "weight_decay" in g:
                c.weight_decay, c.has_weight_decay = float(g["weight_decay"]), 1
            c.momentum = float(g.get("momentum", 0.0))
            c.dampening = float(g.get("dampening", 0.0))
            c.nesterov = int(bool(g.get("nesterov", False)))
        ids = list(tensor_groups)
        c_ids = (ctypes.c_uint32 * max(len(ids), 1))(*ids)
        arrays = [(ctypes.c_uint * max(len(tensor_groups[u]), 1))(*tensor_groups[u]) for u in ids]
        c_arrays = (ctypes.POINTER(ctypes.c_uint) * max(len(ids), 1))(
            *[ctypes.cast(a, ctypes.POINTER(ctypes.c_uint)) for a in arrays])
        for u in ids:
            if len(tensor_groups[u]) != len(self._units[u].tensors):
                raise InvalidArgumentError(
                    "set groups: unit %s has %d tensors, %d groups given" %
                    (self._units[u].name, len(self._units[u].tensors), len(tensor_groups[u])))
        _check(self._lib.zd_set_groups(self._handle, c_groups, len(groups), c_ids, c_arrays,
                                       len(ids)), "set groups")

    def step(self, *, lr: Optional[float] = None, max_grad_norm: Optional[float] = None,
             grad_scale: Optional[float] = None,
             group_lrs: Optional[Sequence[float]] = None) -> StepResult:
        """An optimizer step over all units (collective). `lr` (group 0's)
        or `group_lrs` (every group's, after :meth:`set_groups`) and
        `max_grad_norm` change the job's values from this step on;
        gradients are divided by `grad_scale` (averaging, loss scaling).
        Every rank must pass the same options: options that differ raise
        InvalidArgumentError on every rank, naming the field, and the step
        does not happen (the reduced gradients stay)."""
        options = _lib.sized(_lib.StepOptions)
        keep = None
        if group_lrs is not None:
            keep = (ctypes.c_double * max(len(group_lrs), 1))(*[float(x) for x in group_lrs])
            options.group_lr = ctypes.cast(keep, ctypes.POINTER(ctypes.c_double))
            options.ngroup_lr = len(group_lrs)
        if lr is not None:
            options.set_lr, options.lr = 1, float(lr)
        if max_grad_norm is not None:
            options.set_max_grad_norm, options.max_grad_norm = 1, float(max_grad_norm)
        if grad_scale is not None:
            options.grad_scale = float(grad_scale)
        out = _lib.sized(_lib.StepResult)
        _check(self._lib.zd_step(self._handle, ctypes.byref(options), ctypes.byref(out)), "step")
        return StepResult(int(out.step), int(out.version), float(out.grad_norm), bool(out.skipped),
                          float(out.loss_scale))

    def state_dict(self) -> Dict[str, np.ndarray]:
        """Every tensor of every known unit, copied out (a collective for
        read-write jobs; for a pinned read-only job, all from one
        version)."""
        out: Dict[str, np.ndarray] = {}
        for unit in self.units:
            with unit.gather() as gathered:
                for name, array in gathered.arrays().items():
                    out[name] = array.copy()
        return out

    def recover(self, timeout_s: float = 300.0) -> "Job":
        """Attaches to this job again after it failed because it was
        rebuilt (:meth:`Client.reattach`); returns the new :class:`Job`,
        whose ``stats()[0]["step"]`` is the step training goes on from."""
        return self.client.reattach(self, timeout_s)

    def detach(self) -> None:
        """Detaches from the job (the job and its state stay in the daemon)."""
        _check(self._lib.zd_detach(self._handle), "detach")

    def __repr__(self) -> str:
        mode = "read-only" if self.read_only else "rank %d of %d" % (self.rank, self.world_size)
        return "<zerod.Job %s %s version %d>" % (self.name, mode, self.version)


class Unit:
    """A registered unit: its name, tensors and flat layout. ``from_base``
    is True for a unit this worker registered as a reference to its job's
    base (:meth:`Job.register` with ``from_base=True``): frozen, gathered
    read-only from the node's base cache, with no gradient buffer."""

    def __init__(self, job: Job, info: _lib.UnitInfo) -> None:
        self.job = job
        self.id: int = int(info.unit)
        self.name: str = info.name.decode()
        self.numel: int = int(info.numel)
        self.padded_numel: int = int(info.padded_numel)
        self._dtype_code = int(info.dtype)
        self.dtype: str = _DTYPE_NAMES.get(self._dtype_code, "unknown")
        tensors = []
        for i in range(info.ntensors):
            t = info.tensors[i]
            shape = tuple(int(t.shape[d]) for d in range(t.ndim))
            tensors.append(TensorInfo(t.name.decode(), shape, int(t.offset), int(t.numel)))
        self.tensors: Tuple[TensorInfo, ...] = tuple(tensors)
        self.from_base = False

    def gather(self, delta: bool = False) -> "Gathered":
        """Gathers the unit's full values (collective for read-write jobs).
        Read-only jobs, with `delta`: the daemon writes only the blocks that
        changed since this session's previous gather of the unit, listed in
        the result's ``delta`` (a :class:`zerod.Delta`; docs/subscribe.md)."""
        view = _lib.sized(_lib.View)
        if not delta:
            _check(self.job._lib.zd_gather(self.job._handle, self.id, ctypes.byref(view)),
                   "gather %s" % self.name)
            return Gathered(self, view, writable=False)
        answer = _lib.sized(_lib.Delta)
        _check(self.job._lib.zd_gather_delta(self.job._handle, self.id, ctypes.byref(view),
                                             ctypes.byref(answer)),
               "delta gather %s" % self.name)
        gathered = Gathered(self, view, writable=False)
        gathered.delta = _subscribe.Delta(answer)
        return gathered

    def release(self) -> None:
        """Releases a gathered unit (one-way: no round trip). A unit that is
        not gathered raises here (FailedPreconditionError); only an error of
        the daemon's own state surfaces on the next call that waits."""
        _check(self.job._lib.zd_release(self.job._handle, self.id), "release %s" % self.name)

    def grad_buffer(self) -> "Buffer":
        """The unit's gradient buffer, writable, valid until :meth:`reduce`."""
        view = _lib.sized(_lib.View)
        _check(self.job._lib.zd_grad_buffer(self.job._handle, self.id, ctypes.byref(view)),
               "gradient buffer of %s" % self.name)
        return Buffer(self, view, writable=True)

    def reduce(self, wait: bool = True) -> None:
        """Reduce-scatters the gradient buffer into the ranks' accumulators
        (collective; several reduces before a step accumulate). With
        ``wait=False`` it only sends the request: the buffer is the
        daemon's until the unit's next :meth:`grad_buffer` returns, and an
        error surfaces on the next call that waits."""
        fn = self.job._lib.zd_reduce if wait else self.job._lib.zd_reduce_async
        _check(fn(self.job._handle, self.id), "reduce %s" % self.name)

    def load(self, values: Union[np.ndarray, Sequence[np.ndarray], None], *,
             state: str = "weights", step: Optional[int] = None) -> int:
        """Sets the unit's values from rank 0's `values` (as in
        :meth:`Job.register`; other ranks pass None). `state` is what they
        replace: ``"weights"`` (the fp32 master and the working copy; the
        version goes up), ``"exp_avg"`` / ``"momentum_buffer"`` or
        ``"exp_avg_sq"`` (the optimizer's moments). With `step` the job's
        completed-step count becomes `step` (the next step's bias correction
        continues from it). Collective; returns the job's version."""
        code = _state_code(state, "load %s" % self.name)
        ptr = None
        packed = None
        if values is not None:
            packed = _pack(values, self.numel_packed, "load %s" % self.name)
            ptr = packed.ctypes.data
        version = ctypes.c_uint64()
        step_value = ctypes.c_uint64(int(step)) if step is not None else None
        _check(self.job._lib.zd_load_state(self.job._handle, self.id, code, ptr,
                                           ctypes.byref(step_value) if step_value is not None
                                           else None, ctypes.byref(version)),
               "load %s" % self.name)
        return int(version.value)

    def read_state(self, state: str = "weights") -> Tuple[np.ndarray, int]:
        """The unit's fp32 weights (``"weights"``) or an optimizer moment
        (``"exp_avg"`` / ``"momentum_buffer"``, ``"exp_avg_sq"``), whole:
        the tensors' values back to back, and the job's completed steps.
        Collective over the job's ranks."""
        code = _state_code(state, "read state of %s" % self.name)
        out = np.empty(self.numel_packed, dtype=np.float32)
        step = ctypes.c_uint64()
        _check(self.job._lib.zd_read_state(self.job._handle, self.id, code, out.ctypes.data,
                                           out.size, ctypes.byref(step)),
               "read %s of %s" % (state, self.name))
        return out, int(step.value)

    @property
    def numel_packed(self) -> int:
        """The unit's tensors' elements, summed (its values back to back)."""
        return sum(t.numel for t in self.tensors)

    def __repr__(self) -> str:
        return "<zerod.Unit %s: %d tensors, %d elements, %s%s>" % (
            self.name, len(self.tensors), self.numel, self.dtype,
            ", from the base" if self.from_base else "")


class Buffer:
    """A unit-sized buffer (gathered or gradient): shared memory, or GPU
    memory when the daemon runs with ``--device cuda`` (``device`` is then
    the CUDA ordinal and ``address`` a device pointer; ``device`` is -1 for
    shared memory). The numpy and torch views below need shared memory."""

    def __init__(self, unit: Unit, view: _lib.View, writable: bool) -> None:
        self.unit = unit
        self.address = int(view.base or 0)
        self.nbytes = int(view.bytes)
        self.device = int(view.device)
        self.dtype: str = _DTYPE_NAMES.get(int(view.dtype), "unknown")
        self._dtype_code = int(view.dtype)
        self.version = int(view.version)
        self.writable = writable
        # A device pointer must never be read as host memory.
        self._memory = (_memory(self.address, self.nbytes, unit.job.client)
                        if self.device < 0 else None)

    def _host_memory(self) -> ctypes.Array:
        if self._memory is None:
            raise InvalidArgumentError(
                "unit %s: the buffer is in memory of GPU %d (zerod --device cuda); use "
                ".address and .device" % (self.unit.name, self.device))
        return self._memory

    def array(self) -> np.ndarray:
        """The whole flat buffer as a numpy array (no copy; bfloat16 values
        appear as uint16 bit patterns)."""
        memory = self._host_memory()
        dtype = _NUMPY_DTYPES[self._dtype_code]
        count = self.nbytes // np.dtype(dtype).itemsize
        array = np.frombuffer(memory, dtype=dtype, count=count)
        if not self.writable:
            array.flags.writeable = False
        return array

    def arrays(self) -> Dict[str, np.ndarray]:
        """Each tensor as a numpy view of the buffer, by name."""
        flat = self.array()
        return {t.name: flat[t.offset:t.offset + t.numel].reshape(t.shape)
                for t in self.unit.tensors}

    def flat_tensor(self) -> Any:
        """The whole buffer as a torch tensor (no copy)."""
        import torch

        dtypes = {_lib.F32: torch.float32, _lib.BF16: torch.bfloat16, _lib.F16: torch.float16}
        dtype = dtypes[self._dtype_code]
        memory = self._host_memory()
        count = self.nbytes // torch.tensor([], dtype=dtype).element_size()
        return torch.frombuffer(memory, dtype=dtype, count=count)

    def tensors(self) -> Dict[str, Any]:
        """Each tensor as a torch view of the buffer, by name (no copy).
        Gathered buffers are mapped read-only: writing to them crashes."""
        flat = self.flat_tensor()
        return {t.name: flat[t.offset:t.offset + t.numel].view(t.shape) for t in self.unit.tensors}


class Gathered(Buffer):
    """A gathered unit; ``version`` is the version its values come from;
    ``delta`` what a delta gather wrote (None for a plain gather). Use as a
    context manager to release it."""

    delta: Optional["_subscribe.Delta"] = None

    def release(self) -> None:
        self.unit.release()

    def __enter__(self) -> "Gathered":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()
