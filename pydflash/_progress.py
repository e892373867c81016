"""Deprecated: a thin ``ProgressBar`` over tqdm, kept only for ``pydflash.train.pipeline``.

Every other module draws its progress with tqdm directly (the bar huggingface_hub draws too).
Remove this file once the training pipeline uses tqdm itself.
"""

from __future__ import annotations

from tqdm.auto import tqdm


class ProgressBar:
    """``label: done / total`` as a tqdm bar on stderr; enabled=None: only on a terminal."""

    def __init__(self, label: str, total: float, *, unit: str = "", scale: float = 1.0,
                 enabled: bool | None = None) -> None:
        self._bar = tqdm(total=total / scale if scale != 1.0 else total, desc=label, unit=unit.strip() or "it",
                         disable=None if enabled is None else not enabled, leave=True)
        self.scale = scale
        self.done = 0.0

    @property
    def label(self) -> str:
        return str(self._bar.desc)

    @label.setter
    def label(self, value: str) -> None:
        self._bar.set_description_str(value, refresh=False)

    @property
    def total(self) -> float:
        return float(self._bar.total or 0) * self.scale

    @total.setter
    def total(self, value: float) -> None:
        self._bar.total = value / self.scale

    def update(self, done: float) -> None:
        self._bar.update((done - self.done) / self.scale)
        self.done = done

    def advance(self, n: float) -> None:
        self.update(self.done + n)

    def close(self) -> None:
        self._bar.close()
