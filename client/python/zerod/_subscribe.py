"""Subscribers: a read-only attachment that follows a training job's
versions (docs/subscribe.md).

``Job.watch`` waits for a version newer than the one held and pins it, so
that every unit read for that update comes from one version; it says which
units changed and how many versions went by unseen (a slow subscriber is
taken to the latest, nothing queues). ``Client.subscribe`` wraps it in an
iterator of updates; ``zerod.torch.follow`` loads each update into a plain
torch module in place.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict, Iterator, List, Optional, Tuple

import numpy as np

from . import _lib

if TYPE_CHECKING:  # pragma: no cover
    from .client import Client, Job, Unit

MAX_TIMEOUT_S = 24 * 3600.0
NO_VERSION = 2**64 - 1  # ZD_NO_VERSION


class Delta:
    """What a delta gather wrote into a unit's buffer (docs/subscribe.md,
    "Deltas"). ``full``: the buffer was filled whole (read every byte);
    otherwise it held ``from_version``'s values (the session's previous
    gather of the unit) and only ``blocks`` (indices of ``block_bytes``-byte
    blocks of the unit's buffer) were written."""

    def __init__(self, answer: _lib.Delta) -> None:
        self.full = bool(answer.full)
        self.from_version: Optional[int] = None if self.full else int(answer.from_version)
        self.block_bytes = int(answer.block_bytes)
        self.nblocks = int(answer.nblocks)
        self.blocks = np.zeros(0, dtype=np.int64)
        if not self.full and self.nblocks > 0:
            bits = np.ctypeslib.as_array(answer.changed, shape=((self.nblocks + 7) // 8,))
            flags = np.unpackbits(bits, bitorder="little")[:self.nblocks]
            self.blocks = np.flatnonzero(flags)

    def runs(self, itemsize: int) -> List[Tuple[int, int]]:
        """The changed elements (of `itemsize` bytes) of the unit's flat
        buffer as [start, stop) ranges, adjacent blocks merged."""
        per_block = self.block_bytes // itemsize
        out: List[Tuple[int, int]] = []
        for b in self.blocks.tolist():
            start, stop = b * per_block, (b + 1) * per_block
            if out and out[-1][1] == start:
                out[-1] = (out[-1][0], stop)
            else:
                out.append((start, stop))
        return out

    def __repr__(self) -> str:
        if self.full:
            return "<zerod.Delta full>"
        return "<zerod.Delta from version %d: %d of %d blocks>" % (
            self.from_version, len(self.blocks), self.nblocks)


def _copy_unit(gathered: Any, target: Dict[str, Any], runs: Optional[List[Tuple[int, int]]],
               use_torch: bool) -> int:
    """Copies a gathered unit's tensors into target's arrays of the same
    names: whole (runs None), or only the elements in runs. Returns the
    elements copied."""
    sources = gathered.tensors() if use_torch else gathered.arrays()
    copied = 0
    for t in gathered.unit.tensors:
        dst = target[t.name]
        if runs is None or (use_torch and not dst.is_contiguous()):
            if use_torch:
                dst.copy_(sources[t.name])
            else:
                dst[...] = sources[t.name]
            copied += t.numel
            continue
        src_flat = sources[t.name].reshape(-1)
        dst_flat = dst.view(-1) if use_torch else dst.reshape(-1)
        for start, stop in runs:
            a, b = max(start, t.offset), min(stop, t.offset + t.numel)
            if a >= b:
                continue
            if use_torch:
                dst_flat[a - t.offset:b - t.offset].copy_(src_flat[a - t.offset:b - t.offset])
            else:
                dst_flat[a - t.offset:b - t.offset] = src_flat[a - t.offset:b - t.offset]
            copied += b - a
    return copied


class Update:
    """One version a subscriber moved to: ``version`` (now pinned),
    ``skipped`` (versions published since the previous one and never
    seen), ``step`` (the job's completed steps when the daemon answered:
    the step that made the version may still be finishing) and ``units``, the
    units to read for it: those that changed since the version held, and
    those no earlier update listed (new units). ``read()`` and ``read_torch()``
    copy them out, all from this version."""

    def __init__(self, job: "Job", version: int, skipped: int, step: int,
                 units: List["Unit"], held: Optional[Dict[int, int]] = None) -> None:
        self.job = job
        self.version = version
        self.skipped = skipped
        self.step = step
        self.units = units
        # The subscription's record of the version apply() last wrote of
        # each unit into its target.
        self._held = held if held is not None else {}

    def _each(self, delta: bool = False) -> Iterator[Any]:
        for unit in self.units:
            gathered = unit.gather(delta=delta)
            try:
                if gathered.version != self.version:
                    raise AssertionError("zerod: unit %s came from version %d, not the pinned %d"
                                         % (unit.name, gathered.version, self.version))
                yield gathered
            finally:
                gathered.release()

    def read(self) -> Dict[str, np.ndarray]:
        """Every changed tensor, by name, copied as numpy arrays of the
        job's working dtype (bfloat16 as uint16 bit patterns)."""
        out: Dict[str, np.ndarray] = {}
        for gathered in self._each():
            out.update({name: a.copy() for name, a in gathered.arrays().items()})
        return out

    def read_torch(self) -> Dict[str, Any]:
        """Every changed tensor, by name, copied as torch tensors of the
        job's working dtype."""
        out: Dict[str, Any] = {}
        for gathered in self._each():
            out.update({name: t.clone() for name, t in gathered.tensors().items()})
        return out

    def apply(self, target: Dict[str, Any]) -> int:
        """Brings `target` (tensor name: a writable numpy array, or torch
        tensor, of the tensor's shape; any dtype) to this version, in place,
        with delta gathers: a unit whose values the subscription applied to
        `target` at the delta's from_version gets only its changed blocks,
        any other unit every element. Apply every update of a subscription
        to the same target. Returns the elements copied."""
        copied = 0
        for gathered in self._each(delta=True):
            unit = gathered.unit
            missing = [t.name for t in unit.tensors if t.name not in target]
            if missing:
                raise KeyError("zerod: job %s has tensor %s, which the target lacks"
                               % (self.job.name, missing[0]))
            use_torch = not isinstance(target[unit.tensors[0].name], np.ndarray)
            d = gathered.delta
            whole = d.full or self._held.get(unit.id) != d.from_version
            itemsize = gathered.array().itemsize
            copied += _copy_unit(gathered, target, None if whole else d.runs(itemsize),
                                 use_torch)
            self._held[unit.id] = self.version
        return copied

    def __repr__(self) -> str:
        return "<zerod.Update %s version %d step %d: %d units, %d skipped>" % (
            self.job.name, self.version, self.step, len(self.units), self.skipped)


def timeout_ms(timeout_s: Optional[float]) -> int:
    """zd_watch's timeout: None or 0 answers at once."""
    if timeout_s is None:
        return 0
    if not 0 <= timeout_s <= MAX_TIMEOUT_S:
        raise ValueError("watch timeout_s %r is out of range (0 to 24 h)" % timeout_s)
    return int(round(timeout_s * 1000))


def update_of(job: "Job", update: _lib.Update) -> Optional[Update]:
    """The Update zd_watch filled in; None when it timed out."""
    if update.timed_out:
        return None
    # zd_watch has listed any unit new to the library; no round trip here.
    job._refresh_units()
    units = [job._units[int(update.changed[i])] for i in range(update.nchanged)]
    return Update(job, int(update.version), int(update.skipped), int(update.step), units)


class Subscription:
    """Iterates over a job's versions as they are published, each an
    :class:`Update`, from a read-only attachment on a connection of its own
    to the client's daemon (a connection serves one job). Each wait lasts
    at most ``timeout_s`` (None: a day at a time, forever); a wait that
    times out ends the iteration. ``close()`` (or the ``with`` block's end)
    detaches and closes the connection."""

    def __init__(self, client: "Client", job: str, *, token: Optional[str] = None,
                 timeout_s: Optional[float] = None) -> None:
        from .client import Client

        self.timeout_s = timeout_s
        self.client = Client(client.socket)
        try:
            # No stable addresses: a subscriber's buffers stay mapped where
            # they are, with no remapping at each gather (the default's
            # mmap with MAP_POPULATE and back costs more than the copy).
            self.job = self.client.attach(job, read_only=True, pin=True, token=token,
                                          create=False, stable_addresses=False)
        except BaseException:
            self.client.close()
            raise
        self.version: Optional[int] = None  # the version held: none yet
        self._held: Dict[int, int] = {}  # unit id: version Update.apply wrote
        self._closed = False

    def next(self, timeout_s: Optional[float] = None) -> Optional[Update]:
        """The next update, waiting at most timeout_s (default: the
        subscription's); None when it timed out."""
        wait = self.timeout_s if timeout_s is None else timeout_s
        update = self.job.watch(self.version, timeout_s=MAX_TIMEOUT_S if wait is None else wait)
        if update is not None:
            self.version = update.version
            update._held = self._held
        return update

    def __iter__(self) -> Iterator[Update]:
        while True:
            update = self.next()
            if update is None:
                if self.timeout_s is None:
                    continue  # a day passed: wait again
                return
            yield update

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            try:
                self.job.detach()
            finally:
                self.client.close()

    def __enter__(self) -> "Subscription":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
