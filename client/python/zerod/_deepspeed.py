"""JobConfig.from_deepspeed: a DeepSpeed JSON config read into a JobConfig.

The same mapping as zerodctl's ``jobs create --deepspeed-config``
(client/zerodctl_deepspeed.c); the two must agree key for key, message for
message (tests/python/test_zerod_deepspeed.py feeds both the same files).

The document is walked once: every key whose dotted path is in ``_SCHEMA``
is type-checked (a wrong type is an error naming the key), every other key
is ignored and reported (the top-most unknown path, its subtree with it),
and a known key whose value is ``"auto"`` (DeepSpeed's Hugging Face
integration fills those in) counts as absent and is reported as
``path (auto)``. ``null`` counts as absent. Then the known values are
mapped; what no longer applies (the other optimizer's hyper-parameters,
fp16's loss scaling when fp16 is off) is reported with the reason.
"""

from __future__ import annotations

import json
import math
import os
import warnings
from typing import Any, Dict, List, Mapping, Tuple, Union

from .errors import InvalidArgumentError

# Kinds of value: an object, a number, an integer (with its range), true or
# false, a string, a list of two numbers.
_OBJ, _NUM, _INT, _BOOL, _STR, _PAIR = "obj", "num", "int", "bool", "str", "pair"
_U32 = (0, 4294967295)

_SCHEMA: Dict[str, Tuple[str, Tuple[int, int]]] = {
    "zero_optimization": (_OBJ, _U32),
    "zero_optimization.stage": (_INT, (0, 3)),
    "zero_optimization.offload_optimizer": (_OBJ, _U32),
    "zero_optimization.offload_optimizer.device": (_STR, _U32),
    "zero_optimization.offload_optimizer.nvme_path": (_STR, _U32),
    "zero_optimization.offload_optimizer.buffer_count": (_INT, _U32),
    "zero_optimization.offload_optimizer.buffer_size": (_INT, (0, 1 << 53)),
    "zero_optimization.offload_optimizer.pin_memory": (_BOOL, _U32),
    "zero_optimization.zero_quantized_weights": (_BOOL, _U32),
    "zero_optimization.zero_quantized_gradients": (_BOOL, _U32),
    "zero_optimization.zero_hpz_partition_size": (_INT, _U32),
    "optimizer": (_OBJ, _U32),
    "optimizer.type": (_STR, _U32),
    "optimizer.params": (_OBJ, _U32),
    "optimizer.params.lr": (_NUM, _U32),
    "optimizer.params.betas": (_PAIR, _U32),
    "optimizer.params.eps": (_NUM, _U32),
    "optimizer.params.weight_decay": (_NUM, _U32),
    "optimizer.params.adam_w_mode": (_BOOL, _U32),
    "optimizer.params.momentum": (_NUM, _U32),
    "optimizer.params.dampening": (_NUM, _U32),
    "optimizer.params.nesterov": (_BOOL, _U32),
    "optimizer.params.freeze_step": (_INT, _U32),
    "bf16": (_OBJ, _U32),
    "bf16.enabled": (_BOOL, _U32),
    "fp16": (_OBJ, _U32),
    "fp16.enabled": (_BOOL, _U32),
    "fp16.loss_scale": (_NUM, _U32),
    "fp16.initial_scale_power": (_INT, (0, 63)),
    "fp16.loss_scale_window": (_INT, _U32),
    "fp16.hysteresis": (_INT, _U32),
    "fp16.min_loss_scale": (_NUM, _U32),
    "gradient_clipping": (_NUM, _U32),
}

_ADAM_PARAMS = ("betas", "eps", "adam_w_mode")
_SGD_PARAMS = ("momentum", "dampening", "nesterov")
_FP16_SCALING = ("loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis",
                 "min_loss_scale")
_OPTIMIZER_TYPES = {"adamw": "adamw", "adam": "adam", "sgd": "sgd", "onebitadam": "adamw"}
_OFFLOAD_DEVICES = ("cpu", "nvme", "none")
_STAGE_NOTE = ("zero_optimization.stage %d: zerod shards parameters, gradients and optimizer "
               "states alike (as stage 3)")


def _bad(message: str) -> InvalidArgumentError:
    return InvalidArgumentError("DeepSpeed config: " + message)


def _is_number(v: Any) -> bool:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return False
    try:
        return math.isfinite(v)
    except OverflowError:  # an int past a double's range
        return False


def _check(path: str, value: Any) -> Any:
    """value, type-checked against the schema (integers given as integral
    reals, 1e8, become ints); raises naming path."""
    kind, (lo, hi) = _SCHEMA[path]
    if kind == _OBJ and not isinstance(value, Mapping):
        raise _bad("%s must be an object" % path)
    if kind == _NUM and not _is_number(value):
        raise _bad("%s must be a number" % path)
    if kind == _BOOL and not isinstance(value, bool):
        raise _bad("%s must be true or false" % path)
    if kind == _STR and not isinstance(value, str):
        raise _bad("%s must be a string" % path)
    if kind == _PAIR and not (isinstance(value, list) and len(value) == 2 and
                              all(_is_number(v) for v in value)):
        raise _bad("%s must be a list of two numbers" % path)
    if kind == _INT:
        if not _is_number(value) or value != math.floor(value) or not lo <= value <= hi:
            raise _bad("%s must be an integer from %d to %d" % (path, lo, hi))
        value = int(value)
    return value


def _walk(doc: Mapping[str, Any], prefix: str, found: Dict[str, Any],
          ignored: List[str]) -> None:
    for key, value in doc.items():
        path = prefix + key
        if path not in _SCHEMA:
            ignored.append(path)
        elif isinstance(value, str) and value == "auto":
            ignored.append(path + " (auto)")
        elif value is not None:
            value = _check(path, value)
            if isinstance(value, Mapping):
                _walk(value, path + ".", found, ignored)
            else:
                found[path] = value


def _optimizer(found: Dict[str, Any], ignored: List[str], out: Dict[str, Any]) -> None:
    kind = "adamw"
    if "optimizer.type" in found:
        kind = _OPTIMIZER_TYPES.get(found["optimizer.type"].lower(), "")
        if not kind:
            raise _bad("optimizer.type '%s' is not supported: AdamW, Adam, OneBitAdam or SGD" %
                       found["optimizer.type"])
    # OneBitAdam: AdamW with 1-bit compression after freeze_step (DeepSpeed's
    # default 100000).
    freeze = found.pop("optimizer.params.freeze_step", None)
    if found.get("optimizer.type", "").lower() == "onebitadam":
        out["onebit_freeze_step"] = int(freeze if freeze is not None else 100000)
    elif freeze is not None:
        ignored.append("optimizer.params.freeze_step (not for this optimizer.type)")
    # DeepSpeed's Adam decouples weight decay (AdamW) unless adam_w_mode is false.
    if kind == "adam" and found.get("optimizer.params.adam_w_mode", True):
        kind = "adamw"
    out["optimizer"] = kind
    sgd = kind == "sgd"
    for name in _ADAM_PARAMS + _SGD_PARAMS:
        path = "optimizer.params." + name
        if path in found and (name in _SGD_PARAMS) != sgd:
            ignored.append("%s (not for %s)" % (path, kind))
            del found[path]
    if "optimizer.params.lr" in found:
        out["lr"] = float(found["optimizer.params.lr"])
    if "optimizer.params.betas" in found:
        out["betas"] = tuple(float(b) for b in found["optimizer.params.betas"])
    if "optimizer.params.weight_decay" in found:
        out["weight_decay"] = float(found["optimizer.params.weight_decay"])
    for name in ("eps", "momentum", "dampening"):
        if "optimizer.params." + name in found:
            out[name] = float(found["optimizer.params." + name])
    if "optimizer.params.nesterov" in found:
        out["nesterov"] = found["optimizer.params.nesterov"]


def _precision(found: Dict[str, Any], ignored: List[str], out: Dict[str, Any]) -> None:
    bf16 = found.get("bf16.enabled", False)
    fp16 = found.get("fp16.enabled", False)
    if bf16 and fp16:
        raise _bad("bf16.enabled and fp16.enabled are both true: enable one")
    if bf16:
        out["dtype"] = "bfloat16"
    if not fp16:
        for name in _FP16_SCALING:
            if "fp16." + name in found:
                ignored.append("fp16.%s (fp16 not enabled)" % name)
        return
    out["dtype"] = "float16"
    static = float(found.get("fp16.loss_scale", 0.0))
    if static < 0:
        raise _bad("fp16.loss_scale must be 0 (dynamic) or more")
    # What the file leaves out takes DeepSpeed's defaults, not zerod's.
    out["loss_scale_window"] = found.get("fp16.loss_scale_window", 1000)
    out["loss_scale_hysteresis"] = found.get("fp16.hysteresis", 2)
    if static > 0:
        # A static scale: never grown, never backed off below itself.
        out["loss_scale"] = out["loss_scale_min"] = static
        out["loss_scale_growth"] = 1.0
    else:
        out["loss_scale"] = float(2 ** found.get("fp16.initial_scale_power", 16))
        out["loss_scale_min"] = float(found.get("fp16.min_loss_scale", 1.0))


def _zero(found: Dict[str, Any], notes: List[str], out: Dict[str, Any]) -> None:
    stage = found.get("zero_optimization.stage", 3)
    if stage != 3:
        notes.append(_STAGE_NOTE % stage)
    prefix = "zero_optimization.offload_optimizer."
    offload = {name: found[prefix + name]
               for name in ("device", "nvme_path", "buffer_count", "buffer_size", "pin_memory")
               if prefix + name in found}
    if "device" in offload and offload["device"] not in _OFFLOAD_DEVICES:
        raise _bad("%sdevice must be 'cpu', 'nvme' or 'none'" % prefix)
    if len(offload.get("nvme_path", "").encode()) > 255:
        raise _bad("%snvme_path is longer than 255 bytes" % prefix)
    if offload:
        out["offload_optimizer"] = offload
    if "zero_optimization.zero_quantized_weights" in found:
        out["quantized_weights"] = found["zero_optimization.zero_quantized_weights"]
    # DeepSpeed's qgZ sends int4 blocks between nodes.
    if found.get("zero_optimization.zero_quantized_gradients", False):
        out["quantized_gradients"] = 4
    if "zero_optimization.zero_hpz_partition_size" in found:
        out["hpz_partition_size"] = found["zero_optimization.zero_hpz_partition_size"]


def read(doc: Any) -> Tuple[Dict[str, Any], List[str], List[str]]:
    """JobConfig's fields from a DeepSpeed config (a parsed JSON object),
    the ignored keys (sorted, each "path" or "path (reason)") and notes."""
    if not isinstance(doc, Mapping):
        raise _bad("the document must be a JSON object")
    found: Dict[str, Any] = {}
    ignored: List[str] = []
    notes: List[str] = []
    out: Dict[str, Any] = {}
    _walk(doc, "", found, ignored)
    _zero(found, notes, out)
    _optimizer(found, ignored, out)
    _precision(found, ignored, out)
    if "gradient_clipping" in found:
        out["max_grad_norm"] = float(found["gradient_clipping"])
    return out, sorted(ignored), notes


def load(path_or_dict: Union[str, "os.PathLike[str]", Mapping[str, Any]]) -> Any:
    """The parsed document: a JSON file's, or anything else as given."""
    if not isinstance(path_or_dict, (str, os.PathLike)):
        return path_or_dict
    with open(os.fspath(path_or_dict), encoding="utf-8") as f:
        text = f.read()
    try:
        return json.loads(text)
    except ValueError as e:
        raise _bad("%s is not JSON: %s" % (os.fspath(path_or_dict), e)) from None


def fields(path_or_dict: Union[str, "os.PathLike[str]", Mapping[str, Any]],
           strict: bool) -> Dict[str, Any]:
    """JobConfig's keyword arguments; warns (or, strict, raises) about what
    was ignored, and warns the notes."""
    out, ignored, notes = read(load(path_or_dict))
    if ignored and strict:
        raise _bad("keys zerod does not use: " + ", ".join(ignored))
    if ignored:
        warnings.warn("ignored DeepSpeed keys: " + ", ".join(ignored), UserWarning, stacklevel=3)
    for note in notes:
        warnings.warn(note, UserWarning, stacklevel=3)
    return out
