"""The ``ple`` sweep's progress: one bar over its points, on stderr (tqdm, through :func:`command.bar`)."""

from __future__ import annotations

from . import command


# ---------------------------------------------------------------------------------------------- progress
class Progress:
    """``total`` steps; :meth:`step` counts one and says what it was, :meth:`note` says what runs now."""

    def __init__(self, total: int, *, enabled: bool = True, desc: str = "points") -> None:
        with command.progress(enabled):
            self._bar = command.bar(total=max(1, total), desc=desc, unit="step")

    def step(self, what: str) -> None:
        self._bar.set_postfix_str(what, refresh=False)
        self._bar.update(1)

    def note(self, what: str) -> None:
        self._bar.set_postfix_str(what)

    def close(self) -> None:
        self._bar.close()
