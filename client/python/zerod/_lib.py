"""ctypes declarations of libzerod (client/include/zerod.h).

Every struct here mirrors the C header field for field, as of the ABI this
package is written for (``ABI_VERSION``, the soname's number:
``libzerod.so.1``); the structs the caller allocates carry their own size
(``struct_size``) so that the library can tell which fields a caller knows
about. The library is found, in order, at ``$ZEROD_LIBRARY``, next to this
package (``zerod/lib/libzerod.so``), in a build tree of the repository this
package sits in (``build/*/lib``), and then wherever the dynamic loader
finds ``libzerod.so.1``. A candidate of another ABI (its functions are not
in the ``ZEROD_1`` version node) is passed over: these declarations would
not match it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from pathlib import Path
from typing import List, Optional

c_size_t = ctypes.c_size_t
c_uint64 = ctypes.c_uint64
c_uint32 = ctypes.c_uint32
c_int = ctypes.c_int
c_uint = ctypes.c_uint
c_double = ctypes.c_double
c_char_p = ctypes.c_char_p
c_void_p = ctypes.c_void_p

# The soname's number of the libzerod these declarations describe, and the
# version node its symbols carry (client/libzerod.map).
ABI_VERSION = 1
_ABI_NODE = b"ZEROD_%d" % ABI_VERSION

# zd_dtype
F32, BF16, F16 = 1, 2, 3
# zd_optimizer
ADAMW, ADAM, SGD = 1, 2, 3
# zd_init
INIT_FROM_RANK0, INIT_SEEDED_NORMAL, INIT_ZEROS = 1, 2, 3


class JobConfig(ctypes.Structure):
    _fields_ = [
        ("struct_size", c_size_t),
        ("optimizer", c_int),
        ("lr", c_double),
        ("beta1", c_double),
        ("beta2", c_double),
        ("eps", c_double),
        ("weight_decay", c_double),
        ("has_weight_decay", c_int),
        ("momentum", c_double),
        ("dampening", c_double),
        ("nesterov", c_int),
        ("working_dtype", c_int),
        ("max_live_bytes", c_uint64),
        ("max_grad_norm", c_double),
        ("collectives", c_int),
        ("quantized_weights", c_int),
        ("quantization_block", c_uint),
        ("quantized_gradients", c_uint),
        ("gradient_comm_dtype", c_int),
        ("hpz_partition_size", c_uint),
        ("loss_scale", c_double),
        ("loss_scale_window", c_uint),
        ("loss_scale_growth", c_double),
        ("loss_scale_backoff", c_double),
        ("loss_scale_hysteresis", c_uint),
        ("loss_scale_min", c_double),
        ("offload_device", c_int),
        ("nvme_path", ctypes.c_char * 256),
        ("offload_buffer_count", c_uint),
        ("offload_buffer_size", c_uint64),
        ("offload_pin_memory", c_int),
        ("base_job", ctypes.c_char * 65),
        ("onebit_freeze_step", c_uint),
        ("powersgd_rank", c_uint),
        ("powersgd_start_step", c_uint),
    ]


class AttachOptions(ctypes.Structure):
    _fields_ = [
        ("struct_size", c_size_t),
        ("job", c_char_p),
        ("local_rank", c_uint),
        ("token", c_char_p),
        ("read_only", c_int),
        ("create", c_int),
        ("config", ctypes.POINTER(JobConfig)),
        ("pin", c_int),
        ("stable_addresses", c_int),
        ("world_size", c_uint),
    ]


class TensorDesc(ctypes.Structure):
    _fields_ = [
        ("struct_size", c_size_t),
        ("name", c_char_p),
        ("shape", ctypes.POINTER(c_uint64)),
        ("ndim", c_uint),
        ("frozen", c_int),
    ]


class UnitDesc(ctypes.Structure):
    _fields_ = [
        ("struct_size", c_size_t),
        ("name", c_char_p),
        ("tensors", ctypes.POINTER(TensorDesc)),
        ("ntensors", c_uint),
        ("init", c_int),
        ("seed", c_uint64),
        ("init_std", c_double),
        ("init_values", ctypes.POINTER(ctypes.c_float)),
        ("from_base", c_int),
    ]


class TensorView(ctypes.Structure):
    _fields_ = [
        ("name", c_char_p),
        ("data", c_void_p),
        ("shape", ctypes.POINTER(c_uint64)),
        ("ndim", c_uint),
        ("numel", c_uint64),
        ("offset", c_uint64),
    ]


class View(ctypes.Structure):
    _fields_ = [
        ("struct_size", c_size_t),
        ("base", c_void_p),
        ("bytes", c_size_t),
        ("dtype", c_int),
        ("version", c_uint64),
        ("ntensors", c_uint),
        ("tensors", ctypes.POINTER(TensorView)),
        ("device", ctypes.c_int),  # -1: shared memory; else the CUDA ordinal (base is a device pointer)
        ("event", c_void_p),
    ]


class StepOptions(ctypes.Structure):
    _fields_ = [
        ("struct_size", c_size_t),
        ("set_lr", c_int),
        ("lr", c_double),
        ("set_max_grad_norm", c_int),
        ("max_grad_norm", c_double),
        ("grad_scale", c_double),
        ("group_lr", ctypes.POINTER(c_double)),
        ("ngroup_lr", c_uint),
    ]


class ParamGroup(ctypes.Structure):
    _fields_ = [
        ("struct_size", c_size_t),
        ("lr", c_double),
        ("beta1", c_double),
        ("beta2", c_double),
        ("eps", c_double),
        ("weight_decay", c_double),
        ("has_weight_decay", c_int),
        ("momentum", c_double),
        ("dampening", c_double),
        ("nesterov", c_int),
    ]


class StepResult(ctypes.Structure):
    _fields_ = [
        ("struct_size", c_size_t),
        ("step", c_uint64),
        ("version", c_uint64),
        ("grad_norm", c_double),
        ("skipped", c_int),
        ("loss_scale", c_double),
    ]


class CheckpointInfo(ctypes.Structure):
    _fields_ = [
        ("struct_size", c_size_t),
        ("name", ctypes.c_char * 65),
        ("step", c_uint64),
        ("stall_ms", ctypes.c_int64),
        ("total_ms", ctypes.c_int64),
    ]


class Update(ctypes.Structure):
    _fields_ = [
        ("struct_size", c_size_t),
        ("version", c_uint64),
        ("timed_out", c_int),
        ("skipped", c_uint64),
        ("step", c_uint64),
        ("nchanged", c_uint),
        ("changed", ctypes.POINTER(c_uint32)),
    ]


class Delta(ctypes.Structure):
    _fields_ = [
        ("struct_size", c_size_t),
        ("full", c_int),
        ("from_version", c_uint64),
        ("block_bytes", c_size_t),
        ("nblocks", c_size_t),
        ("nchanged", c_size_t),
        ("changed", ctypes.POINTER(ctypes.c_uint8)),
    ]


class Pending(ctypes.Structure):
    _fields_ = [("struct_size", c_size_t), ("request_id", c_uint64), ("unit", c_uint32)]


class UnitInfo(ctypes.Structure):
    _fields_ = [
        ("struct_size", c_size_t),
        ("unit", c_uint32),
        ("name", c_char_p),
        ("ntensors", c_uint),
        ("tensors", ctypes.POINTER(TensorView)),
        ("numel", c_uint64),
        ("padded_numel", c_uint64),
        ("dtype", c_int),
    ]


MAX_COLLECTIVE_COUNTERS = 16  # ZD_MAX_COLLECTIVE_COUNTERS


class CollectiveCounter(ctypes.Structure):
    _fields_ = [
        ("level", ctypes.c_char * 16),
        ("collective", ctypes.c_char * 24),
        ("bytes", c_uint64),
        ("calls", c_uint64),
    ]


class RankStats(ctypes.Structure):
    _fields_ = [
        ("struct_size", c_size_t),
        ("rank", c_uint),
        ("step", c_uint64),
        ("ncounters", c_uint),
        ("counters", CollectiveCounter * MAX_COLLECTIVE_COUNTERS),
        ("pool_bytes", c_uint64),
        ("secondary_bytes", c_uint64),
        ("state_bytes", c_uint64),
        ("tier_bytes", c_uint64),
        ("host_state_bytes", c_uint64),
        ("comm_seconds", c_double),
        ("wait_seconds", c_double),
        ("exposed_comm_seconds", c_double),
    ]


def sized(struct_type: type) -> ctypes.Structure:
    """A zeroed struct with its struct_size set (ZD_SIZED_INIT)."""
    value = struct_type()
    value.struct_size = ctypes.sizeof(struct_type)
    return value


def sized_array(struct_type: type, count: int) -> ctypes.Array:
    """An array of zeroed structs, each with its struct_size set."""
    array = (struct_type * count)()
    for element in array:
        element.struct_size = ctypes.sizeof(struct_type)
    return array


_P = ctypes.POINTER
_SIGNATURES = {
    "zd_default_socket": (c_char_p, []),
    "zd_connect": (c_int, [c_char_p, _P(c_void_p)]),
    "zd_close": (None, [c_void_p]),
    "zd_attach": (c_int, [c_void_p, _P(AttachOptions), _P(c_void_p)]),
    "zd_job_rank": (c_uint, [c_void_p]),
    "zd_job_world_size": (c_uint, [c_void_p]),
    "zd_job_version": (c_uint64, [c_void_p]),
    "zd_job_read_only": (c_int, [c_void_p]),
    "zd_job_attach_warning": (c_char_p, [c_void_p]),
    "zd_list_units": (c_int, [c_void_p, _P(c_uint)]),
    "zd_job_unit_count": (c_uint, [c_void_p]),
    "zd_job_unit_info": (c_int, [c_void_p, c_uint, _P(UnitInfo)]),
    "zd_pin": (c_int, [c_void_p, _P(c_uint64)]),
    "zd_watch": (c_int, [c_void_p, c_uint64, c_int, _P(Update)]),
    "zd_job_loss_scale": (c_double, [c_void_p]),
    "zd_grad_norm": (c_int, [c_void_p, c_double, _P(c_double)]),
    "zd_checkpoint_save": (c_int, [c_void_p, c_char_p, _P(CheckpointInfo)]),
    "zd_checkpoint_restore": (c_int, [c_void_p, c_char_p, _P(CheckpointInfo)]),
    "zd_job_stats": (c_int, [c_void_p, _P(RankStats), c_uint, _P(c_uint)]),
    "zd_job_effective_config": (c_int, [c_void_p, _P(JobConfig)]),
    "zd_load_unit": (c_int, [c_void_p, c_uint32, c_void_p, _P(c_uint64)]),
    "zd_set_groups": (c_int, [c_void_p, _P(ParamGroup), c_uint, _P(c_uint32),
                              _P(_P(c_uint)), c_uint]),
    "zd_load_state": (c_int, [c_void_p, c_uint32, c_int, c_void_p, _P(c_uint64), _P(c_uint64)]),
    "zd_read_state": (c_int, [c_void_p, c_uint32, c_int, c_void_p, c_size_t, _P(c_uint64)]),
    "zd_register_unit": (c_int, [c_void_p, _P(UnitDesc), _P(c_uint32)]),
    "zd_gather": (c_int, [c_void_p, c_uint32, _P(View)]),
    "zd_gather_delta": (c_int, [c_void_p, c_uint32, _P(View), _P(Delta)]),
    "zd_gather_async": (c_int, [c_void_p, c_uint32, _P(Pending)]),
    "zd_gather_wait": (c_int, [c_void_p, _P(Pending), _P(View)]),
    "zd_release": (c_int, [c_void_p, c_uint32]),
    "zd_grad_buffer": (c_int, [c_void_p, c_uint32, _P(View)]),
    "zd_reduce": (c_int, [c_void_p, c_uint32]),
    "zd_reduce_async": (c_int, [c_void_p, c_uint32]),
    "zd_step": (c_int, [c_void_p, _P(StepOptions), _P(StepResult)]),
    "zd_detach": (c_int, [c_void_p]),
    "zd_strerror": (c_char_p, [c_int]),
    "zd_last_error": (c_char_p, []),
}


def _candidates() -> List[str]:
    found: List[str] = []
    env = os.environ.get("ZEROD_LIBRARY")
    if env:
        found.append(env)
    here = Path(__file__).resolve().parent
    found.append(str(here / "lib" / "libzerod.so"))
    # A checkout: client/python/zerod -> the repository root.
    root = here.parent.parent.parent
    for build in ("release", "debug"):
        found.append(str(root / "build" / build / "lib" / "libzerod.so"))
    name = ctypes.util.find_library("zerod")
    if name:
        found.append(name)
    found.append("libzerod.so.%d" % ABI_VERSION)
    return found


def _abi_mismatch(lib: ctypes.CDLL) -> Optional[str]:
    """Why `lib` is not the ABI these declarations describe, or None: its
    zd_connect must be versioned ZEROD_<ABI_VERSION> (glibc's dlvsym; where
    there is none, the library is taken as it is)."""
    try:
        dlvsym = ctypes.CDLL(None).dlvsym
    except (OSError, AttributeError):
        return None
    dlvsym.restype = c_void_p
    dlvsym.argtypes = [c_void_p, c_char_p, c_char_p]
    if dlvsym(lib._handle, b"zd_connect", _ABI_NODE):
        return None
    return "not libzerod.so.%d: no zd_connect@%s" % (ABI_VERSION, _ABI_NODE.decode())


_lib: Optional[ctypes.CDLL] = None


def load() -> ctypes.CDLL:
    """Loads libzerod once and declares its functions."""
    global _lib
    if _lib is not None:
        return _lib
    tried = []
    for path in _candidates():
        if os.path.sep in path and not os.path.exists(path):
            tried.append(path + " (missing)")
            continue
        try:
            lib = ctypes.CDLL(path)
        except OSError as err:
            tried.append("%s (%s)" % (path, err))
            continue
        mismatch = _abi_mismatch(lib)
        if mismatch is not None:
            tried.append("%s (%s)" % (path, mismatch))
            continue
        for name, (restype, argtypes) in _SIGNATURES.items():
            fn = getattr(lib, name)
            fn.restype = restype
            fn.argtypes = argtypes
        _lib = lib
        return lib
    raise ImportError(
        "zerod: cannot find libzerod.so.%d; build it (`make` in the repository) or set "
        "ZEROD_LIBRARY to its path. Tried: %s" % (ABI_VERSION, "; ".join(tried)))
