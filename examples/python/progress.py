"""A small progress bar for training loops (no dependencies).

On a terminal the bar is redrawn in place with a carriage return:

    [#####-----] 120/200 loss 2.31 val 2.40 tok/s 9.1k eta 12s

Anywhere else (a pipe, a log file, CI) redrawing would leave a mess of
carriage returns, so the same line is printed as an ordinary line once every
`every` steps and at the end. Messages printed with `Progress.log` appear
above the bar on a terminal and as plain lines elsewhere.
"""

from __future__ import annotations

import sys
import time
from typing import Optional, TextIO


def format_count(value: float) -> str:
    """Formats a rate or count compactly: 950, 9.1k, 12.3M."""
    for limit, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= limit:
            return f"{value / limit:.1f}{suffix}"
    return f"{value:.0f}"


def format_duration(seconds: float) -> str:
    """Formats a duration as 42s, 3m05s or 1h02m."""
    seconds = max(0, int(round(seconds)))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


class Progress:
    """Shows the progress of `total` steps, with a loss and a throughput.

    `units_per_step` (for example tokens per step) gives the rate shown as
    "tok/s"; `every` is how often a line is printed when the output is not a
    terminal.
    """

    def __init__(
        self,
        total: int,
        units_per_step: int = 0,
        unit: str = "tok",
        every: int = 50,
        width: int = 20,
        stream: Optional[TextIO] = None,
        start: int = 0,
    ) -> None:
        self.total = total
        self.units_per_step = units_per_step
        self.unit = unit
        self.every = max(1, every)
        self.width = width
        self.stream = stream if stream is not None else sys.stdout
        self.interactive = self.stream.isatty()
        self.start_step = start
        self.step = start
        self.loss: Optional[float] = None
        self.val: Optional[float] = None
        self._t0 = time.monotonic()
        self._drawn = False

    def elapsed(self) -> float:
        """Seconds since the bar was created."""
        return time.monotonic() - self._t0

    def rate(self) -> float:
        """Steps per second since the bar was created."""
        done = self.step - self.start_step
        elapsed = self.elapsed()
        return done / elapsed if done > 0 and elapsed > 0 else 0.0

    def line(self) -> str:
        """The current state as one line (without a newline)."""
        filled = self.width * self.step // self.total if self.total else self.width
        parts = [f"[{'#' * filled}{'-' * (self.width - filled)}] {self.step}/{self.total}"]
        if self.loss is not None:
            parts.append(f"loss {self.loss:.2f}")
        if self.val is not None:
            parts.append(f"val {self.val:.2f}")
        rate = self.rate()
        if rate > 0:
            if self.units_per_step:
                parts.append(f"{self.unit}/s {format_count(rate * self.units_per_step)}")
            else:
                parts.append(f"it/s {rate:.2f}")
            parts.append(f"eta {format_duration((self.total - self.step) / rate)}")
        return " ".join(parts)

    def update(self, step: int, loss: Optional[float] = None,
               val: Optional[float] = None) -> None:
        """Records that `step` steps are done, with the latest losses."""
        self.step = step
        if loss is not None:
            self.loss = loss
        if val is not None:
            self.val = val
        if self.interactive:
            self._draw()
        elif step % self.every == 0 or step == self.total:
            self.stream.write(self.line() + "\n")
            self.stream.flush()

    def log(self, message: str) -> None:
        """Prints a message; on a terminal, above the bar, which is redrawn."""
        if self.interactive and self._drawn:
            self.stream.write("\r\033[K")
        self.stream.write(message + "\n")
        if self.interactive and self._drawn:
            self._draw()
        self.stream.flush()

    def close(self) -> None:
        """Ends the bar's line on a terminal so later output starts clean."""
        if self.interactive and self._drawn:
            self.stream.write("\n")
            self.stream.flush()
            self._drawn = False

    def _draw(self) -> None:
        self.stream.write("\r\033[K" + self.line())
        self.stream.flush()
        self._drawn = True
