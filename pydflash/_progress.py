"""One small progress line on stderr, shared by pulls, conversion and quantization."""

from __future__ import annotations

import sys
import time


class ProgressBar:
    """``label: done / total unit (pct%)`` rewritten in place; silent unless enabled.

    enabled=None means "only when stderr is a terminal", so logs and CI stay clean.
    """

    def __init__(self, label: str, total: float, *, unit: str = "", scale: float = 1.0,
                 enabled: bool | None = None) -> None:
        self.label, self.total, self.unit, self.scale = label, total, unit, scale
        self.enabled = sys.stderr.isatty() if enabled is None else enabled
        self.done = 0.0
        self._last = 0.0

    def update(self, done: float) -> None:
        self.done = done
        now = time.monotonic()
        if self.enabled and (now - self._last > 0.1 or done >= self.total):
            self._last = now
            pct = 100.0 * done / self.total if self.total else 100.0
            sys.stderr.write(
                f"\r{self.label}: {done / self.scale:.1f} / {self.total / self.scale:.1f}{self.unit} ({pct:3.0f}%)"
            )
            sys.stderr.flush()

    def advance(self, n: float) -> None:
        self.update(self.done + n)

    def close(self) -> None:
        if self.enabled:
            sys.stderr.write("\n")
            sys.stderr.flush()
