"""JobConfig: a job's optimizer, precision, offload and collectives, as an
attach that creates the job sends them (libzerod's zd_job_config)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple, Union

from . import _deepspeed, _lib
from .errors import InvalidArgumentError
from .policies import MixedPrecisionPolicy, OffloadPolicy, dtype_name

_DTYPE_NAMES = {_lib.F32: "float32", _lib.BF16: "bfloat16", _lib.F16: "float16"}
_DTYPE_CODES = {name: code for code, name in _DTYPE_NAMES.items()}
_OPTIMIZERS = {"adamw": _lib.ADAMW, "adam": _lib.ADAM, "sgd": _lib.SGD}
_COLLECTIVES = {"hierarchical": 1, "flat": 2}
_OFFLOAD_DEVICES = {"none": 1, "cpu": 2, "nvme": 3}


@dataclass
class JobConfig:
    """A job's optimizer and precision, used when an attach creates the job.

    ``None`` and zero fields take torch.optim's defaults (AdamW: lr 1e-3,
    betas (0.9, 0.999), eps 1e-8, weight decay 0.01). ``dtype`` is the
    working precision of gathered buffers ("float32" or "bfloat16");
    ``max_live_bytes`` bounds the gathered and gradient buffers per rank (0:
    the daemon's default); ``max_grad_norm`` > 0 clips every step.
    ``collectives`` is how a job on several nodes sums: "hierarchical" (the
    default: node by node, fewer bytes between nodes) or "flat" (every rank
    in rank order, bit-identical to one process). ``quantized_weights``
    (ZeRO++ qwZ) all-gathers a multi-node job's weights as int8 blocks of
    ``quantization_block`` elements (0: 256); ``quantized_gradients`` (qgZ:
    0, 8 or 4 bits) sends its partial gradient sums between nodes
    quantized, and ``gradient_comm_dtype="bfloat16"`` in bf16.
    ``hpz_partition_size`` (hpZ: 0 or 1 off, else the job's ranks per node)
    keeps a per-node secondary partition of each gathered unit so that its
    later gathers at the same version (the backward pass) stay in the node.
    ``dtype="float16"`` scales the loss dynamically (``loss_scale``: the
    initial scale, 0: 65536 for float16 and off otherwise, negative: off;
    ``loss_scale_window`` 2000, ``loss_scale_growth`` 2,
    ``loss_scale_backoff`` 0.5, ``loss_scale_hysteresis`` 1,
    ``loss_scale_min`` 1 when 0).
    ``offload_optimizer`` is DeepSpeed's: ``{"device": "nvme", "nvme_path":
    ..., "buffer_count": 4, "buffer_size": 1048576, "pin_memory": False}``
    keeps the fp32 master weights and moments in a file per rank under the
    daemon's ``--nvme-dir`` (``nvme_path``, if given, inside it), streamed
    through ``buffer_count`` buffers of ``buffer_size`` elements per state
    at each step; ``"cpu"`` is host memory (what CPU ranks do anyway; a
    GPU rank keeps its gradients and working copy on the GPU and steps on
    the CPU through the same buffers, page-locked with ``pin_memory``).
    The typed forms of zerod.policies are taken too: ``offload_optimizer``
    an ``OffloadPolicy`` (``CPUOffloadPolicy``, ``NVMeOffloadPolicy``),
    ``mixed_precision`` a ``MixedPrecisionPolicy`` (its ``param_dtype`` is
    ``dtype``, its ``reduce_dtype`` ``gradient_comm_dtype``), and a dtype
    may be a torch or numpy dtype.
    ``base_job`` makes the job a job on a base (docs/bases.md): the name
    of a frozen job (``zerodctl jobs freeze``) on the same nodes, with the
    same world size and working dtype, whose units this job's workers may
    register as references (``Job.register(..., from_base=True)``;
    ``zerod.torch.shard(..., base=True)``). "" (the default): none.
    ``onebit_freeze_step`` > 0 is 1-bit Adam (DeepSpeed's OneBitAdam, for
    an Adam or AdamW job on several nodes with hierarchical collectives):
    that many exact steps, then the second moment frozen and each node's
    partial gradient sums sent between nodes as signs with a scale per
    ``quantization_block`` elements and error feedback
    (docs/compression.md).
    ``powersgd_rank`` > 0 is low-rank (PowerSGD) compression of the same
    sums (a job on several nodes with hierarchical collectives): each
    node's partial sums for another node's slice cross nodes as two factors
    of that rank (1 to 64), with error feedback and a warm start
    (docs/compression.md); ``powersgd_start_step`` steps stay exact first.
    """

    optimizer: str = "adamw"
    lr: Optional[float] = None
    betas: Tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: Optional[float] = None
    momentum: float = 0.0
    dampening: float = 0.0
    nesterov: bool = False
    dtype: Any = "float32"
    max_live_bytes: int = 0
    max_grad_norm: float = 0.0
    collectives: str = "hierarchical"
    quantized_weights: bool = False
    quantization_block: int = 0
    quantized_gradients: int = 0
    gradient_comm_dtype: Any = "float32"
    hpz_partition_size: int = 0
    loss_scale: float = 0.0
    loss_scale_window: int = 0
    loss_scale_growth: float = 0.0
    loss_scale_backoff: float = 0.0
    loss_scale_hysteresis: int = 0
    loss_scale_min: float = 0.0
    offload_optimizer: Union[OffloadPolicy, Dict[str, Any], None] = None
    mixed_precision: Optional[MixedPrecisionPolicy] = None
    base_job: str = ""
    onebit_freeze_step: int = 0
    powersgd_rank: int = 0
    powersgd_start_step: int = 0

    def _dtypes(self) -> Tuple[str, str]:
        """The working and gradient-exchange dtypes' names, from the strings
        or dtypes given or the mixed precision policy (not both)."""
        working = dtype_name(self.dtype, "dtype")
        comm = dtype_name(self.gradient_comm_dtype, "gradient_comm_dtype")
        mp = self.mixed_precision
        if mp is not None and mp.param_dtype is not None:
            if working != "float32":
                raise InvalidArgumentError("dtype and mixed_precision.param_dtype both given: "
                                           "give one")
            working = dtype_name(mp.param_dtype, "mixed_precision.param_dtype")
        if mp is not None and mp.reduce_dtype is not None:
            if comm != "float32":
                raise InvalidArgumentError("gradient_comm_dtype and mixed_precision.reduce_dtype "
                                           "both given: give one")
            comm = dtype_name(mp.reduce_dtype, "mixed_precision.reduce_dtype")
        return working, comm

    def _to_c(self) -> _lib.JobConfig:
        if self.optimizer not in _OPTIMIZERS:
            raise InvalidArgumentError("unknown optimizer %r (adamw, adam or sgd)" % self.optimizer)
        working, comm = self._dtypes()
        c = _lib.sized(_lib.JobConfig)
        c.optimizer = _OPTIMIZERS[self.optimizer]
        c.lr = float(self.lr or 0.0)
        c.beta1, c.beta2 = (float(b) for b in self.betas)
        c.eps = float(self.eps)
        if self.weight_decay is not None:
            c.weight_decay = float(self.weight_decay)
            c.has_weight_decay = 1
        c.momentum = float(self.momentum)
        c.dampening = float(self.dampening)
        c.nesterov = int(bool(self.nesterov))
        c.working_dtype = _DTYPE_CODES[working]
        c.max_live_bytes = int(self.max_live_bytes)
        c.max_grad_norm = float(self.max_grad_norm)
        if self.collectives not in _COLLECTIVES:
            raise InvalidArgumentError("collectives must be 'hierarchical' or 'flat', not %r" %
                                       self.collectives)
        c.collectives = _COLLECTIVES[self.collectives]
        c.quantized_weights = int(bool(self.quantized_weights))
        c.quantization_block = int(self.quantization_block)
        if self.quantized_gradients not in (0, 4, 8):
            raise InvalidArgumentError("quantized_gradients must be 0, 4 or 8, not %r" %
                                       self.quantized_gradients)
        c.quantized_gradients = int(self.quantized_gradients)
        if comm not in ("float32", "bfloat16"):
            raise InvalidArgumentError("gradient_comm_dtype must be 'float32' or 'bfloat16', "
                                       "not %r" % comm)
        c.gradient_comm_dtype = _DTYPE_CODES[comm]
        if int(self.hpz_partition_size) < 0:
            raise InvalidArgumentError("hpz_partition_size must be 0 or more, not %r" %
                                       self.hpz_partition_size)
        c.hpz_partition_size = int(self.hpz_partition_size)
        c.loss_scale = float(self.loss_scale)
        c.loss_scale_window = int(self.loss_scale_window)
        c.loss_scale_growth = float(self.loss_scale_growth)
        c.loss_scale_backoff = float(self.loss_scale_backoff)
        c.loss_scale_hysteresis = int(self.loss_scale_hysteresis)
        c.loss_scale_min = float(self.loss_scale_min)
        offload = (self.offload_optimizer.as_dict()
                   if isinstance(self.offload_optimizer, OffloadPolicy)
                   else dict(self.offload_optimizer or {}))
        unknown = set(offload) - {"device", "nvme_path", "buffer_count", "buffer_size",
                                  "pin_memory"}
        if unknown:
            raise InvalidArgumentError("offload_optimizer: unknown keys %s (device, nvme_path, "
                                       "buffer_count, buffer_size, pin_memory)" % sorted(unknown))
        device = offload.get("device", "none")
        if device not in _OFFLOAD_DEVICES:
            raise InvalidArgumentError("offload_optimizer device must be 'none', 'cpu' or "
                                       "'nvme', not %r" % device)
        c.offload_device = _OFFLOAD_DEVICES[device]
        path = str(offload.get("nvme_path") or "").encode()
        if len(path) >= 256:
            raise InvalidArgumentError("offload_optimizer nvme_path is longer than 255 bytes")
        c.nvme_path = path
        c.offload_buffer_count = int(offload.get("buffer_count", 0))
        c.offload_buffer_size = int(offload.get("buffer_size", 0))
        c.offload_pin_memory = int(bool(offload.get("pin_memory", False)))
        base = str(self.base_job or "").encode()
        if len(base) > 64:
            raise InvalidArgumentError("base_job is longer than 64 bytes")
        c.base_job = base
        if int(self.onebit_freeze_step) < 0:
            raise InvalidArgumentError("onebit_freeze_step must be 0 (off) or more, not %r" %
                                       self.onebit_freeze_step)
        c.onebit_freeze_step = int(self.onebit_freeze_step)
        if not 0 <= int(self.powersgd_rank) <= 64:
            raise InvalidArgumentError("powersgd_rank must be 0 (off) or 1 to 64, not %r" %
                                       self.powersgd_rank)
        c.powersgd_rank = int(self.powersgd_rank)
        if int(self.powersgd_start_step) < 0:
            raise InvalidArgumentError("powersgd_start_step must be 0 or more, not %r" %
                                       self.powersgd_start_step)
        c.powersgd_start_step = int(self.powersgd_start_step)
        return c

    @classmethod
    def from_deepspeed(cls, path_or_dict: Any, strict: bool = False) -> "JobConfig":
        """The JobConfig a DeepSpeed JSON config (a file's path, or the
        parsed dict) describes: ZeRO's offload_optimizer and ZeRO++ keys,
        the optimizer and its params, bf16 or fp16 (with its loss scaling;
        what the file leaves out takes DeepSpeed's defaults) and
        gradient_clipping (docs/python.md, "DeepSpeed configs"). Any other
        key, and a known one set to "auto", is ignored: one UserWarning
        lists them all, or with ``strict`` InvalidArgumentError does; a value
        of the wrong type is an InvalidArgumentError naming its key. ZeRO
        stages 0 to 2 are accepted with a warning: zerod shards everything,
        as stage 3 does. zerodctl's ``jobs create --deepspeed-config`` reads
        a file the same way."""
        return cls(**_deepspeed.fields(path_or_dict, strict))

    @classmethod
    def _from_c(cls, c: _lib.JobConfig) -> "JobConfig":
        optimizers = {code: name for name, code in _OPTIMIZERS.items()}
        collectives = {code: name for name, code in _COLLECTIVES.items()}
        return cls(optimizer=optimizers.get(int(c.optimizer), "adamw"), lr=float(c.lr),
                   betas=(float(c.beta1), float(c.beta2)), eps=float(c.eps),
                   weight_decay=float(c.weight_decay), momentum=float(c.momentum),
                   dampening=float(c.dampening), nesterov=bool(c.nesterov),
                   dtype=_DTYPE_NAMES.get(int(c.working_dtype), "float32"),
                   max_live_bytes=int(c.max_live_bytes), max_grad_norm=float(c.max_grad_norm),
                   collectives=collectives.get(int(c.collectives), "hierarchical"),
                   quantized_weights=bool(c.quantized_weights),
                   quantization_block=int(c.quantization_block),
                   quantized_gradients=int(c.quantized_gradients),
                   gradient_comm_dtype=_DTYPE_NAMES.get(int(c.gradient_comm_dtype), "float32"),
                   hpz_partition_size=int(c.hpz_partition_size),
                   loss_scale=float(c.loss_scale), loss_scale_window=int(c.loss_scale_window),
                   loss_scale_growth=float(c.loss_scale_growth),
                   loss_scale_backoff=float(c.loss_scale_backoff),
                   loss_scale_hysteresis=int(c.loss_scale_hysteresis),
                   loss_scale_min=float(c.loss_scale_min),
                   offload_optimizer={
                       "device": {code: name for name, code in _OFFLOAD_DEVICES.items()}.get(
                           int(c.offload_device), "none"),
                       "nvme_path": c.nvme_path.decode(),
                       "buffer_count": int(c.offload_buffer_count),
                       "buffer_size": int(c.offload_buffer_size),
                       "pin_memory": bool(c.offload_pin_memory)},
                   base_job=c.base_job.decode(),
                   onebit_freeze_step=int(c.onebit_freeze_step),
                   powersgd_rank=int(c.powersgd_rank),
                   powersgd_start_step=int(c.powersgd_start_step))
