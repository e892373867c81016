"""``Engine``: a target plus an optional DFlash drafter, generating through the native scheduler.

Every call - ``generate``, ``stream``, ``chat``, ``generate_batch`` - adds sequences to one
``Scheduler`` (``pydflash.runtime.scheduler``) and steps it until they finish. With a drafter each step
drafts a block per sequence, verifies all of them in one target batch and keeps the longest
prefix the target agrees with (exact rejection sampling at T > 0), so the output is the
target's own; under ``n_max="auto"`` the scheduler picks the draft width every step from what
it measures (0: plain decoding, the drafter not run). Without a drafter it decodes plainly.
"""

from __future__ import annotations

import contextlib
import os
import time
from typing import Callable, Iterator, Sequence

from .. import errors
from . import generation, tuning_cache
from .drafter import Drafter
from .generation import Result, SamplingOptions
from .scheduler import Scheduler, StepInfo
from .target import Message, Target


class Engine:
    """Speculative (or plain) generation on a GGUF target.

    Args:
        target: target GGUF path, a ``pydflash models`` name or ``hf:ORG/NAME[:QUANT]`` (``pydflash.fetch.hub``).
        drafter: drafter GGUF path (a ``dflash`` file converted for this target), ``hf:ORG/NAME[:QUANT]``
            (a GGUF repository's file, or a DFlash checkpoint converted for this target and cached), ``"auto"`` (the
            drafter shipped in the package for this target; plain decoding with a warning if
            none matches, see ``pydflash.drafters``), or None (plain decoding).
        n_ctx, n_threads, n_gpu_layers: as for ``Target``.
        n_max: drafts verified per step (llama.cpp's --spec-draft-n-max), clamped to block_size-1.
            ``"auto"`` (the default): the scheduler picks the width every step from measured
            verify/draft costs and the acceptance it sees, 0 (plain decoding) where speculation
            would lose. What it learned is remembered per (files, threads, devices, machine)
            under the cache directory (``PYDFLASH_AUTOTUNE_CACHE=0`` turns that off). None:
            block_size-1.
        n_min: shorter drafts are not verified (--spec-draft-n-min).
        p_min: greedy drafts are cut before the first pick the drafter itself gives a probability
            below p_min (--spec-draft-p-min; 0 = off).
        lookup: greedy generations also draft from their own history: the tokens that followed
            the latest earlier occurrence of their last ``lookup``..4 tokens (code repeats names,
            lines and blocks), verified in place of the drafter's block where the loop prices it
            to pay (a fixed n_max: wherever there is a match); 0 = the drafter only. Without a
            drafter these are the only drafts (a target with no drafter still gains where its
            output repeats). None (default): 2 with a drafter, 0 without (plain decoding).
        n_seq_max: sequences the engine holds at once (generate_batch, the server's slots).
        drafter_device: the ggml device the drafter computes on (``pydflash.runtime.devices``). ``"auto"``
            (the default) follows the target: the first GPU when ``n_gpu_layers != 0``, else the
            CPU. None or ``"cpu"``: the CPU. Or a name such as ``"CUDA0"``.

    Example:
        >>> with Engine("smollm2-135m", "drafter.gguf") as engine:
        ...     r = engine.generate("def fib(n):", max_tokens=64, temperature=0)
        ...     print(r.text, r.stats.tau)
    """

    def __init__(
        self,
        target: str | os.PathLike,
        drafter: str | os.PathLike | None = None,
        *,
        n_ctx: int = 4096,
        n_threads: int | None = None,
        n_gpu_layers: int = 0,
        n_max: int | str | None = "auto",
        n_min: int = 0,
        p_min: float = 0.0,
        lookup: int | None = None,
        n_seq_max: int = 1,
        n_batch: int = 512,
        exact_head: bool = False,
        drafter_device: str | None = "auto",
        verbose: bool = False,
    ) -> None:
        self.target = Target(target, n_ctx=n_ctx, n_threads=n_threads, n_gpu_layers=n_gpu_layers,
                             n_seq_max=n_seq_max, n_batch=n_batch, verbose=verbose)
        self.drafter: Drafter | None = None
        self.scheduler: Scheduler | None = None
        self._tuning_key: str | None = None
        self._saved_at = 0.0  # monotonic time of the last tuning save
        if isinstance(drafter, str) and drafter == "auto":  # the drafter shipped for this target, if any
            from .. import drafters

            drafter = drafters.resolve_auto(self.target)
        from .devices import resolve_drafter_device

        self.auto_n_max = n_max == "auto"
        self.last_widths: dict[int, int] = {}  # draft width -> steps, of the latest call
        self._n_threads = n_threads or os.cpu_count() or 1
        try:
            if drafter is not None:
                self.drafter = Drafter(drafter, self.target, n_ctx=self.target.info.n_ctx, n_threads=n_threads,
                                       exact_head=exact_head,
                                       device=resolve_drafter_device(drafter_device, n_gpu_layers))
            self.n_max, self.n_min = self._check_spec(None if self.auto_n_max else n_max, n_min)
            self.p_min = self._p_min(p_min)
            if self.drafter is not None:
                self._warm_up_drafter()
            self.scheduler = Scheduler(self.target, self.drafter, n_max="auto" if self.auto_n_max else self.n_max,
                                       n_min=self.n_min, p_min=self.p_min, lookup=lookup)
            if self.scheduler.auto:
                self._tuning_key = tuning_cache.key(self.target, self.drafter, n_threads=self._n_threads)
                learned = tuning_cache.load(self._tuning_key)
                if learned:
                    self.scheduler.set_tuning(learned)
        except BaseException:
            self.close()
            raise

    def _warm_up_drafter(self) -> None:
        """Run the drafter's graphs once at their largest shapes (as llama.cpp warms the target up
        at load), so the first generation does not pay for graph allocation."""
        import numpy as np

        d = self.drafter
        n_rows = min(32, d.info.n_ctx)
        zeros = [np.zeros((n_rows, self.target.info.n_embd), dtype=np.float32) for _ in d.target_layers]
        d.inject_taps(zeros, list(range(n_rows)))
        d.propose(max(self.target.info.token_bos, 0), n_rows, d.info.block_size)
        d.crop(0)

    def _check_spec(self, n_max: int | None, n_min: int) -> tuple[int, int]:
        # without a drafter only history drafts are verified: up to 15 of them (the loop's cap)
        block = self.drafter.info.block_size if self.drafter else 16
        if n_max is None:
            n_max = max(block - 1, 1)
        if not isinstance(n_max, int) or isinstance(n_max, bool) or n_max < 0:
            raise errors.InvalidArgumentError(f"n_max must be an int >= 0 or 'auto', got {n_max!r}")
        if not isinstance(n_min, int) or isinstance(n_min, bool) or not 0 <= n_min <= n_max:
            raise errors.InvalidArgumentError(f"n_min must be an int in 0..n_max, got {n_min!r}")
        # a drafter drafts at most block - 1 tokens: a larger n_max (and n_min with it) means "all of them"
        n_max = min(n_max, max(block - 1, 1))
        return n_max, min(n_min, n_max)

    def _p_min(self, p_min: float | None) -> float:
        if p_min is None:
            return self.p_min
        if not isinstance(p_min, (int, float)) or isinstance(p_min, bool) or not 0.0 <= p_min <= 1.0:
            raise errors.InvalidArgumentError(f"p_min must be in [0, 1], got {p_min!r}")
        return float(p_min)

    def spec_overrides(self, n_max: int | None, n_min: int | None, p_min: float | None) -> dict:
        """A call's (or a request's) n_max / n_min / p_min overrides, validated, as Scheduler.add arguments
        (n_max given: this call drafts exactly that many per step; None: the engine's)."""
        spec = {}
        if n_max is not None or n_min is not None:
            k, m = self._check_spec(self.n_max if n_max is None else n_max, self.n_min if n_min is None else n_min)
            if n_max is not None:
                spec["n_max"] = k
            if n_min is not None:
                spec["n_min"] = min(m, k) if n_max is not None else m
        if p_min is not None:
            spec["p_min"] = self._p_min(p_min)
        return spec

    @property
    def last_n_max(self) -> int:
        """The draft width the latest call used most (0: it decoded plainly)."""
        drafting = {w: n for w, n in self.last_widths.items() if w > 0}
        return max(drafting, key=lambda w: drafting[w]) if drafting else 0

    def tuning(self) -> dict[str, list[float]] | None:
        """What auto mode has learned on this machine (None when n_max is fixed, or when nothing
        drafts: no drafter and no history drafts)."""
        return self.scheduler.tuning() if self.scheduler is not None and self.scheduler.auto else None

    # -- lifetime ------------------------------------------------------------------------------

    def close(self) -> None:
        """Free the scheduler, the drafter and the target (idempotent). Waits for a generation
        running on another thread: it holds the target's lock, so nothing is freed under it."""
        target = getattr(self, "target", None)
        with target._lock if target is not None else contextlib.nullcontext():
            if getattr(self, "scheduler", None) is not None:
                self._save_tuning()
                self.scheduler.close()
                self.scheduler = None
            if getattr(self, "drafter", None) is not None:
                self.drafter.close()
            if target is not None:
                target.close()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _save_tuning(self) -> None:
        if self._tuning_key and self.scheduler is not None:
            with contextlib.suppress(OSError, errors.PydflashError):
                tuning_cache.save(self._tuning_key, self.scheduler.tuning())

    # -- generation ----------------------------------------------------------------------------

    def _sched(self) -> Scheduler:
        self.target._h()  # ClosedError when closed
        if self.scheduler is None:
            raise errors.ClosedError("the engine is closed")
        return self.scheduler

    def _tokens(self, prompt: str | Sequence[int]) -> list[int]:
        tokens = self.target.tokenize(prompt) if isinstance(prompt, str) else list(prompt)
        self.target._token_array(tokens, allow_empty=False)  # validates
        return tokens

    def _run(self, sched: Scheduler, ids: list[int]) -> list[Result]:
        """Step until `ids` finished (under the target's lock), counting the widths used."""
        widths: dict[int, int] = {}
        wanted = set(ids)
        try:
            while not wanted.issubset(sched.finished()):
                info: StepInfo = sched.step()
                if info.n_decoding:
                    widths[info.width] = widths.get(info.width, 0) + 1
        except BaseException:
            sched.abandon(ids)
            raise
        self.last_widths = widths
        if self._tuning_key and time.monotonic() - self._saved_at > 30.0:  # also if the process dies later
            self._saved_at = time.monotonic()
            self._save_tuning()
        return [sched.take(i) for i in ids]

    def generate(self, prompt: str | Sequence[int], *, n_max: int | None = None, n_min: int | None = None,
                 p_min: float | None = None, on_piece: Callable[[str], bool | None] | None = None,
                 **options) -> Result:  # type: ignore[no-untyped-def]
        """Generate from text or token ids; options as ``Target.generate``; ``n_max`` fixes the
        drafts per step for this call. ``on_piece(text)``, if given, receives the text as it is
        committed (return False to stop)."""
        spec = self.spec_overrides(n_max, n_min, p_min)
        opts = SamplingOptions.build(**options)
        tokens = self._tokens(prompt)
        with self.target._lock:
            sched = self._sched()
            sid = sched.add(tokens, opts, **spec, slot=0, cache_prompt=False, on_piece=on_piece)
            result = self._run(sched, [sid])[0]
        return result

    def stream(self, prompt: str | Sequence[int], *, n_max: int | None = None, n_min: int | None = None,
               p_min: float | None = None, **options) -> Iterator[str]:  # type: ignore[no-untyped-def]
        """Like ``generate`` but yields text pieces as they are committed; closing the iterator
        cancels the generation."""
        spec = self.spec_overrides(n_max, n_min, p_min)
        opts = SamplingOptions.build(**options)
        tokens = self._tokens(prompt)
        self._sched()

        def call(on_piece: Callable[[str], bool]) -> Result:
            sched = self._sched()
            sid = sched.add(tokens, opts, **spec, slot=0, cache_prompt=False, on_piece=on_piece)
            return self._run(sched, [sid])[0]

        return generation.stream_call(call, self.target._lock)

    def chat(self, messages: Sequence[Message], **options) -> Result:  # type: ignore[no-untyped-def]
        """Generate the assistant's reply with the target's chat template."""
        prompt = self.target.apply_chat_template(messages)
        return self.generate(self.target.tokenize(prompt, parse_special=True), **options)

    def generate_batch(self, prompts: Sequence[str | Sequence[int]], *, n_max: int | None = None,
                       n_min: int | None = None, p_min: float | None = None,
                       on_piece: Callable[[int, str], bool | None] | None = None,
                       **options) -> list[Result]:  # type: ignore[no-untyped-def]
        """Generate for several prompts together: every step drafts one block per sequence (one
        drafter, one context per sequence) and verifies all blocks in one target batch.
        Sequence i samples with ``seed + i``. Needs ``n_seq_max >= len(prompts)``.

        on_piece(i, text), if given, streams sequence i's text; returning False stops sequence i."""
        if not prompts:
            return []
        if len(prompts) > self.target.info.n_seq_max:
            raise errors.InvalidArgumentError(
                f"{len(prompts)} prompts but the engine was created with n_seq_max={self.target.info.n_seq_max}")
        spec = self.spec_overrides(n_max, n_min, p_min)
        opts = SamplingOptions.build(**options)
        token_lists = [self._tokens(p) for p in prompts]
        if opts.seed + len(prompts) > 2**64:
            raise errors.InvalidArgumentError("seed + number of prompts must stay below 2**64")
        with self.target._lock:
            sched = self._sched()
            ids: list[int] = []
            try:
                for i, tokens in enumerate(token_lists):
                    piece = None if on_piece is None else (lambda text, i=i: on_piece(i, text))
                    opts_i = SamplingOptions(**{**opts.__dict__, "seed": opts.seed + i})
                    ids.append(sched.add(tokens, opts_i, **spec, slot=i, cache_prompt=False, on_piece=piece))
            except BaseException:
                sched.abandon(ids)
                raise
            return self._run(sched, ids)
