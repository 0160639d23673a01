"""A plain progress line for long benchmark runs."""

from __future__ import annotations

import math
import sys
import time


# ---------------------------------------------------------------------------------------------- progress
class Progress:
    """A plain progress line on stderr: a redrawn line on a terminal, a line every ``every_s`` otherwise."""

    def __init__(self, total: int, *, stream=None, every_s: float = 15.0, enabled: bool = True):
        self.total = max(1, total)
        self.done = 0
        self.stream = stream if stream is not None else sys.stderr
        self.every_s = every_s
        self.enabled = enabled
        self.t0 = time.perf_counter()
        self._last = -math.inf
        self._tty = bool(getattr(self.stream, "isatty", lambda: False)())

    def step(self, what: str, *, force: bool = False) -> None:
        self.done = min(self.total, self.done + 1)
        self._show(what, force)

    def note(self, what: str) -> None:
        self._show(what, True)

    def _show(self, what: str, force: bool) -> None:
        if not self.enabled:
            return
        now = time.perf_counter()
        if not self._tty and not force and now - self._last < self.every_s:
            return
        self._last = now
        elapsed = now - self.t0
        frac = self.done / self.total
        eta = elapsed / frac - elapsed if frac > 0 else float("nan")
        width = 20
        bar = "#" * int(frac * width) + "-" * (width - int(frac * width))
        line = (f"[{bar}] {self.done}/{self.total} {frac:4.0%} {_hms(elapsed)} elapsed"
                f"{'' if math.isnan(eta) else ' ~' + _hms(eta) + ' left'}  {what}")
        if self._tty:
            self.stream.write("\r\x1b[2K" + line[:200])
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.enabled and self._tty:
            self.stream.write("\n")
            self.stream.flush()


def _hms(seconds: float) -> str:
    seconds = int(round(seconds))
    return f"{seconds // 60}:{seconds % 60:02d}"
