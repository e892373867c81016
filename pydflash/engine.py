"""``Engine``: a target plus an optional DFlash drafter, generating through one native loop.

With a drafter, every step drafts a block, verifies it in one target batch and keeps the
longest prefix the target agrees with (exact rejection sampling at T > 0), so the output is the
target's own. With ``drafter=None`` the same loop decodes plainly, one token per step.
"""

from __future__ import annotations

import contextlib
import os
from typing import Callable, Iterator, Sequence

from . import autotune, errors, generation
from ._bindings import check, ffi, lib
from .drafter import Drafter
from .generation import Result, SamplingOptions
from .target import Message, Target


class Engine:
    """Speculative (or plain) generation on a GGUF target.

    Args:
        target: target GGUF path or a ``pydflash models`` name.
        drafter: drafter GGUF path (a ``dflash`` file converted for this target), ``"auto"`` (the
            drafter shipped in the package for this target; plain decoding with a warning if
            none matches, see ``pydflash.drafters``), or None (plain decoding).
        n_ctx, n_threads, n_gpu_layers: as for ``Target``.
        n_max: drafts verified per step (llama.cpp's --spec-draft-n-max), clamped to block_size-1.
            ``"auto"`` (the default): chosen before each generation from this machine's measured
            verify/draft costs and the acceptance seen so far, 0 (plain decoding) where
            speculation would lose; see ``pydflash.autotune``. None: block_size-1.
        n_min: shorter drafts are not verified (--spec-draft-n-min).
        p_min: greedy drafts are cut before the first pick the drafter itself gives a probability
            below p_min (--spec-draft-p-min; 0 = off).
        drafter_device: the ggml device the drafter computes on (``pydflash.devices``). ``"auto"``
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
        n_seq_max: int = 1,
        exact_head: bool = False,
        drafter_device: str | None = "auto",
        verbose: bool = False,
    ) -> None:
        self.target = Target(target, n_ctx=n_ctx, n_threads=n_threads, n_gpu_layers=n_gpu_layers,
                             n_seq_max=n_seq_max, verbose=verbose)
        self.drafter: Drafter | None = None
        if isinstance(drafter, str) and drafter == "auto":  # the drafter shipped for this target, if any
            from . import drafters

            drafter = drafters.resolve_auto(self.target)
        from .devices import resolve_drafter_device

        self._drafter_args = (drafter, dict(n_ctx=self.target.info.n_ctx, n_threads=n_threads, exact_head=exact_head,
                                            device=resolve_drafter_device(drafter_device, n_gpu_layers)))
        self._seq_drafters: list[Drafter] = []  # drafters of sequences 1.. in generate_batch
        self.auto_n_max = n_max == "auto"
        self.last_n_max = 0  # n_max of the latest generation (the autotuner's pick under "auto")
        self._tuner: autotune.AutoTuner | None = None
        self._n_threads = n_threads or os.cpu_count() or 1
        try:
            if drafter is not None:
                self.drafter = Drafter(drafter, self.target, **self._drafter_args[1])
            self.n_max, self.n_min = self._check_spec(None if self.auto_n_max else n_max, n_min)
            self.p_min = 0.0
            self.p_min = self._p_min(p_min)
        except BaseException:
            self.close()
            raise

    def _check_spec(self, n_max: int | None, n_min: int) -> tuple[int, int]:
        block = self.drafter.info.block_size if self.drafter else 1
        if n_max is None:
            n_max = max(block - 1, 1)
        if not isinstance(n_max, int) or isinstance(n_max, bool) or n_max < 0:
            raise errors.InvalidArgumentError(f"n_max must be an int >= 0 or 'auto', got {n_max!r}")
        if not isinstance(n_min, int) or not 0 <= n_min <= n_max:
            raise errors.InvalidArgumentError(f"n_min must be an int in 0..n_max, got {n_min!r}")
        return min(n_max, max(block - 1, 1)), n_min

    @property
    def autotuner(self) -> autotune.AutoTuner | None:
        """The n_max autotuner (``n_max="auto"`` with a drafter), measuring costs on first use."""
        if not self.auto_n_max or self.drafter is None:
            return None
        if self._tuner is None:
            costs = autotune.cached_costs(self.target, self.drafter, self.target.path, self.drafter.path,
                                          n_threads=self._n_threads)
            acceptance = autotune.AcceptanceModel(n_positions=self.drafter.info.block_size - 1)
            self._tuner = autotune.AutoTuner(costs, acceptance, max_n_max=self.n_max)
        return self._tuner

    def _pick_n_max(self, n_max: int | None) -> int | None:
        """The n_max of one call: the caller's, else the autotuner's pick, else the engine's."""
        if n_max is None and self.autotuner is not None:
            n_max = self.autotuner.choose()
        self.last_n_max = 0 if self.drafter is None else self.n_max if n_max is None else n_max
        return n_max

    def _call_spec(self, n_max: int | None, n_min: int | None, p_min: float | None) -> tuple[int | None, int | None, bool]:
        """Validate a call's n_max / n_min / p_min, then let the autotuner pick n_max if the caller
        did not: (n_max, n_min, picked by the autotuner)."""
        if self.drafter is not None:
            self._check_spec(self.n_max if n_max is None else n_max, self.n_min if n_min is None else n_min)
            self._p_min(p_min)
        auto = n_max is None and self.autotuner is not None
        n_max = self._pick_n_max(n_max)
        if auto:  # a caller's n_min cannot exceed what the tuner picked
            n_min = min(self.n_min if n_min is None else n_min, n_max)
        return n_max, n_min, auto

    def _observe(self, n_max: int | None, auto: bool) -> Callable[[Result], None]:
        def observe(result: Result) -> None:
            if auto and self._tuner is not None and n_max:
                self._tuner.observe(n_max, result.stats)
        return observe

    # -- lifetime ------------------------------------------------------------------------------

    def close(self) -> None:
        """Free the drafter and the target (idempotent). Waits for a generation running on another
        thread: it holds the target's lock, so nothing is freed under it."""
        target = getattr(self, "target", None)
        with target._lock if target is not None else contextlib.nullcontext():
            for d in getattr(self, "_seq_drafters", []):
                d.close()
            if getattr(self, "drafter", None) is not None:
                self.drafter.close()
            if target is not None:
                target.close()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- generation ----------------------------------------------------------------------------

    def generate(self, prompt: str | Sequence[int], *, n_max: int | None = None, n_min: int | None = None,
                 p_min: float | None = None, on_piece: Callable[[str], bool | None] | None = None,
                 **options) -> Result:  # type: ignore[no-untyped-def]
        """Generate from text or token ids; options as ``Target.generate``; n_max / n_min / p_min
        override the engine's settings for this call. ``on_piece(text)``, if given, receives the
        text as it is committed (return False to stop)."""
        n_max, n_min, auto = self._call_spec(n_max, n_min, p_min)
        call, opts = self._generation(prompt, options, n_max, n_min, p_min)
        with self.target._lock:
            result = generation.run(call, opts, on_piece)
        self._observe(n_max, auto)(result)
        return result

    def stream(self, prompt: str | Sequence[int], *, n_max: int | None = None, n_min: int | None = None,
               p_min: float | None = None, **options) -> Iterator[str]:  # type: ignore[no-untyped-def]
        """Like ``generate`` but yields text pieces as they are committed."""
        n_max, n_min, auto = self._call_spec(n_max, n_min, p_min)
        call, opts = self._generation(prompt, options, n_max, n_min, p_min)
        return generation.stream(call, opts, self.target._lock, on_result=self._observe(n_max, auto))

    def chat(self, messages: Sequence[Message], **options) -> Result:  # type: ignore[no-untyped-def]
        """Generate the assistant's reply with the target's chat template."""
        prompt = self.target.apply_chat_template(messages)
        return self.generate(self.target.tokenize(prompt, parse_special=True), **options)

    def generate_batch(self, prompts: Sequence[str | Sequence[int]], *, n_max: int | None = None,
                       n_min: int | None = None, p_min: float | None = None,
                       on_piece: Callable[[int, str], bool | None] | None = None,
                       **options) -> list[Result]:  # type: ignore[no-untyped-def]
        """Generate for several prompts together: every step drafts one block per sequence and
        verifies all blocks in one target batch. Sequence i samples with ``seed + i``. Needs
        ``n_seq_max >= len(prompts)``; each extra sequence loads its own drafter context.

        on_piece(i, text), if given, streams sequence i's text; returning False stops sequence i."""
        if not prompts:
            return []
        if len(prompts) > self.target.info.n_seq_max:
            raise errors.InvalidArgumentError(
                f"{len(prompts)} prompts but the engine was created with n_seq_max={self.target.info.n_seq_max}")
        opts = SamplingOptions.build(**options)
        n_max, n_min, auto = self._call_spec(n_max, n_min, p_min)
        n_max, n_min = self._check_spec(self.n_max if n_max is None else n_max, self.n_min if n_min is None else n_min)
        use_drafter = self.drafter is not None and n_max != 0  # n_max 0: plain decoding, drafter skipped
        token_lists = [self.target.tokenize(p) if isinstance(p, str) else list(p) for p in prompts]
        arrays = [self.target._token_array(t, allow_empty=False) for t in token_lists]
        keepalive: list = []
        params = opts.to_native(keepalive)
        spec = ffi.new("dflash_spec_params *", {"n_max": n_max, "n_min": n_min, "p_min": self._p_min(p_min)})
        outs = ffi.new("dflash_output *[]", len(prompts))
        callback, user_data = ffi.NULL, ffi.NULL
        if on_piece is not None:
            handles = [ffi.new_handle(generation.piece_forwarder(lambda text, i=i: on_piece(i, text)))
                       for i in range(len(prompts))]
            keepalive.append(handles)
            callback, user_data = generation.TOKEN_CALLBACK, ffi.new("void *[]", handles)
        with self.target._lock:  # handles are taken under the lock: a concurrent close() cannot free them
            drafters = ffi.NULL
            if use_drafter:
                while len(self._seq_drafters) < len(prompts) - 1:
                    self._seq_drafters.append(Drafter(self._drafter_args[0], self.target, **self._drafter_args[1]))
                drafters = ffi.new("dflash_drafter *[]", [self.drafter._h()] +
                                   [d._h() for d in self._seq_drafters[: len(prompts) - 1]])
            check(lib.dflash_generate_batch(self.target._h(), drafters, ffi.new("const int32_t *[]", arrays),
                                            ffi.new("int32_t[]", [len(t) for t in token_lists]), len(prompts),
                                            spec, params, callback, user_data, outs))
        results = [generation.take_output(outs[i]) for i in range(len(prompts))]
        for result in results:
            self._observe(n_max, auto)(result)
        return results

    def _p_min(self, p_min: float | None) -> float:
        if p_min is None:
            return self.p_min
        if not isinstance(p_min, (int, float)) or not 0.0 <= p_min <= 1.0:
            raise errors.InvalidArgumentError(f"p_min must be in [0, 1], got {p_min!r}")
        return float(p_min)

    def _generation(self, prompt, options, n_max, n_min, p_min=None):  # type: ignore[no-untyped-def]
        if self.drafter is None or n_max == 0:
            return self.target._generation(prompt, options)  # no drafter, or no drafts this call (e.g. autotuner: off)
        n_max, n_min = self._check_spec(self.n_max if n_max is None else n_max, self.n_min if n_min is None else n_min)
        opts = SamplingOptions.build(**options)
        tokens = self.target.tokenize(prompt) if isinstance(prompt, str) else list(prompt)
        array = self.target._token_array(tokens, allow_empty=False)
        spec = ffi.new("dflash_spec_params *", {"n_max": n_max, "n_min": n_min, "p_min": self._p_min(p_min)})
        self.target._h(), self.drafter._h()  # fail early when closed
        drafter = self.drafter

        def call(params, callback, user_data, out):  # type: ignore[no-untyped-def]
            # runs under the target's lock; handles are read here so a close() in between is seen
            with drafter._lock:
                return lib.dflash_generate_speculative(self.target._h(), drafter._h(), array, len(tokens), spec,
                                                       params, callback, user_data, out)

        return call, opts
