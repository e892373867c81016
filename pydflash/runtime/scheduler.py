"""``Scheduler``: the native stepped scheduler every generation runs through.

One object over a ``Target`` and an optional ``Drafter`` holds up to the target's ``n_seq_max``
sequences. Sequences are added and cancelled between steps; each ``step()`` admits queued
sequences (reusing a slot's cached prompt prefix), drafts one block per decoding sequence at the
width the scheduler picks (fixed ``n_max``, or measured-cost adaptive under ``"auto"``), verifies
all blocks plus prefill chunks of new sequences in one target batch and commits tokens. The
Engine, the CLI and the server are thin users of it.

Not thread-safe: one thread drives it (the Engine under the target's lock, the server on its
step-loop thread).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Callable, Sequence

from .. import errors
from . import generation
from ._bindings import TOKEN_CALLBACK, check, ffi, lib
from .generation import Result, SamplingOptions

__all__ = ["Scheduler", "StepInfo", "SlotInfo"]


@dataclass(frozen=True)
class StepInfo:
    """What one step did."""

    width: int            # drafts per sequence chosen (0: plain)
    probe: bool           # auto mode probed speculation this step
    n_rows: int           # target rows decoded
    n_prefill_rows: int   # of which prompt rows
    n_decoding: int       # sequences that decoded
    n_drafting: int       # of which drafted
    n_committed: int      # tokens committed
    n_finished: int       # finished sequences not yet taken
    n_waiting: int        # sequences queued or running after the step
    t_draft_ms: float
    t_verify_ms: float
    t_step_ms: float


@dataclass(frozen=True)
class SlotInfo:
    id: int           # sequence in the slot (0: free)
    state: str        # "idle", "prefill", "decode"
    n_prompt: int
    n_prefilled: int
    n_generated: int
    n_past: int
    n_cached: int     # tokens whose KV the slot holds
    n_prompt_cached: int = 0  # of the running sequence's prompt: tokens reused from the cache


_SLOT_STATES = {0: "idle", 1: "prefill", 2: "decode"}
_TUNING_FIELDS = ("t_rows_ms", "t_draft_ms", "offered", "accepted", "trim_offered", "trim_accepted", "trim_drafted",
                  "trim_kept", "trim_blocks", "trim_block_kept", "trim_block_accepted")


class Scheduler:
    """The stepped generation loop over ``target`` and ``drafter`` (None: plain decoding).

    Args:
        n_max: drafts per sequence per step; ``"auto"`` (or -1): chosen every step from costs
            and acceptance the loop measures, 0 (drafter not run) where speculation would lose.
        n_min, p_min: as llama.cpp's --spec-draft-n-min / --spec-draft-p-min.
        n_batch: most target rows per step (0: the target's batch size); prefill chunks of new
            sequences share it with the decoding sequences' blocks.
        lookup: greedy sequences also draft from their own history (the tokens after the latest
            earlier occurrence of their last ``lookup``..4 tokens), verified in place of the
            drafter's block where that is priced to pay; 0 = off. Without a drafter these are
            the only drafts. None (default): 2 with a drafter, 0 without (plain decoding).
    """

    def __init__(self, target, drafter=None, *, n_max: int | str = "auto", n_min: int = 0,  # type: ignore[no-untyped-def]
                 p_min: float = 0.0, n_batch: int = 0, lookup: int | None = None) -> None:
        if n_max == "auto":
            n_max = -1
        if not isinstance(n_max, int) or isinstance(n_max, bool) or n_max < -1:
            raise errors.InvalidArgumentError(f"n_max must be an int >= 0 or 'auto', got {n_max!r}")
        if not isinstance(n_batch, int) or n_batch < 0:
            raise errors.InvalidArgumentError(f"n_batch must be an int >= 0, got {n_batch!r}")
        if lookup is None:
            lookup = 2 if drafter is not None else 0
        if not isinstance(lookup, int) or isinstance(lookup, bool) or not 0 <= lookup <= 4:
            raise errors.InvalidArgumentError(f"lookup must be an int in 0..4 (0 = off), got {lookup!r}")
        self.target = target
        self.drafter = drafter
        self.auto = n_max == -1 and (drafter is not None or lookup > 0)
        params = ffi.new("dflash_scheduler_params *", lib.dflash_scheduler_default_params())
        params.n_max, params.n_min, params.p_min, params.n_batch = n_max, n_min, float(p_min), n_batch
        params.lookup = lookup
        self.lookup = lookup
        out = ffi.new("dflash_scheduler **")
        check(lib.dflash_scheduler_create(target._h(), drafter._h() if drafter is not None else ffi.NULL, params, out))
        self._handle = out[0]
        # why the drafter is not used ("" when it is): the CLI and the server say it once; every
        # result's Stats carries it
        self.notice = ffi.string(lib.dflash_scheduler_notice(self._handle)).decode("utf-8", "replace")
        self._callbacks: dict[int, object] = {}  # cffi handles kept alive until the output is taken
        self._failures: dict[int, list[BaseException]] = {}

    # -- lifetime ----------------------------------------------------------------------------------

    def _h(self):  # type: ignore[no-untyped-def]
        if self._handle is None:
            raise errors.ClosedError("the scheduler is closed")
        self.target._h()  # ClosedError once the target (or the drafter) it runs on was closed
        if self.drafter is not None:
            self.drafter._h()
        return self._handle

    def close(self) -> None:
        if self._handle is not None:
            lib.dflash_scheduler_free(self._handle)
            self._handle = None
            self._callbacks.clear()

    def __del__(self) -> None:  # pragma: no cover - interpreter shutdown order
        try:
            self.close()
        except Exception:
            pass

    # -- sequences ---------------------------------------------------------------------------------

    def add(self, tokens: Sequence[int], options: SamplingOptions, *, n_max: int | None = None,
            n_min: int | None = None, p_min: float | None = None,
            slot: int | None = None, cache_prompt: bool = True, capture: bool = False,
            on_piece: Callable[[str], bool | None] | None = None) -> int:
        """Queue a sequence; returns its id. ``on_piece(text)`` streams it (False stops it).
        ``n_max`` fixes this sequence's drafts per step (None: the scheduler's choice); ``n_min`` /
        ``p_min`` override the scheduler's for it. ``capture`` keeps the target's features at the
        ``set_capture`` layers and its argmax for every row the sequence decodes
        (``Result.capture``: training data, captured while it generates)."""
        if n_max is not None and (not isinstance(n_max, int) or isinstance(n_max, bool) or n_max < 0):
            raise errors.InvalidArgumentError(f"n_max must be an int >= 0, got {n_max!r}")
        if n_min is not None and (not isinstance(n_min, int) or isinstance(n_min, bool) or n_min < 0):
            raise errors.InvalidArgumentError(f"n_min must be an int >= 0, got {n_min!r}")
        if p_min is not None and (not isinstance(p_min, (int, float)) or isinstance(p_min, bool)
                                  or not 0.0 <= p_min <= 1.0):
            raise errors.InvalidArgumentError(f"p_min must be in [0, 1], got {p_min!r}")
        if slot is not None and (not isinstance(slot, int) or isinstance(slot, bool)):
            raise errors.InvalidArgumentError(f"slot must be an int, got {slot!r}")
        array = self.target._token_array(tokens, allow_empty=False)
        keepalive: list = []
        gen = options.to_native(keepalive)
        req = ffi.new("dflash_request_params *", lib.dflash_request_default_params())
        req.gen = gen[0]
        req.n_max = -1 if n_max is None else n_max
        req.n_min = -1 if n_min is None else n_min
        req.p_min = -1.0 if p_min is None else float(p_min)
        req.slot = -1 if slot is None else slot
        req.cache_prompt = bool(cache_prompt)
        req.capture = bool(capture)
        failure: list[BaseException] = []
        callback, handle = ffi.NULL, ffi.NULL
        if on_piece is not None:
            handle = ffi.new_handle(generation.piece_forwarder(on_piece, failure))
            callback = TOKEN_CALLBACK
        sid = ffi.new("int32_t *")
        check(lib.dflash_scheduler_add(self._h(), array, len(tokens), req, callback, handle, sid))
        if on_piece is not None:
            self._callbacks[sid[0]] = handle
        self._failures[sid[0]] = failure
        return int(sid[0])

    def set_capture(self, layers: Sequence[int]) -> None:
        """Target layers whose input hidden states ``capture`` requests keep (as
        ``Target.set_taps``; with a drafter: its own tap layers). ``[]`` turns capture off."""
        values = [int(x) for x in layers]
        check(lib.dflash_scheduler_set_capture(self._h(), ffi.new("int32_t[]", values) if values else ffi.NULL,
                                               len(values)))

    def cancel(self, seq_id: int) -> None:
        """Stop a queued or running sequence at the next step."""
        check(lib.dflash_scheduler_cancel(self._h(), seq_id))

    def step(self) -> StepInfo:
        info = ffi.new("dflash_step_info *")
        check(lib.dflash_scheduler_step(self._h(), info))
        return StepInfo(width=info.width, probe=bool(info.probe), n_rows=info.n_rows,
                        n_prefill_rows=info.n_prefill_rows, n_decoding=info.n_decoding, n_drafting=info.n_drafting,
                        n_committed=info.n_committed, n_finished=info.n_finished, n_waiting=info.n_waiting,
                        t_draft_ms=info.t_draft_ms, t_verify_ms=info.t_verify_ms, t_step_ms=info.t_step_ms)

    def finished(self) -> list[int]:
        """Ids of finished sequences whose result was not taken yet."""
        h = self._h()
        n = lib.dflash_scheduler_finished(h, ffi.NULL, 0)
        if n == 0:
            return []
        ids = ffi.new("int32_t[]", n)
        n = lib.dflash_scheduler_finished(h, ids, n)
        return list(ids[0:n])

    def take(self, seq_id: int) -> Result:
        """The result of a finished sequence (it is then forgotten). An exception raised by its
        ``on_piece`` callback is re-raised here."""
        out = ffi.new("dflash_output **")
        check(lib.dflash_scheduler_take(self._h(), seq_id, out))
        self._callbacks.pop(seq_id, None)
        failure = self._failures.pop(seq_id, [])
        result = generation.take_output(out[0])
        if failure:
            raise failure[0]
        if self.notice:
            result = dataclasses.replace(result, stats=dataclasses.replace(result.stats, notice=self.notice))
        return result

    def probs(self, seq_id: int, first: int = 0) -> list[generation.TokenProbs]:
        """Probabilities (``SamplingOptions.n_probs``) of a live or finished sequence's tokens
        committed so far, from token ``first`` on; an ``on_piece`` callback may call it for the
        token just committed ([] when none were asked for)."""
        out = ffi.new("const dflash_output **")
        check(lib.dflash_scheduler_peek(self._h(), seq_id, out))
        n = ffi.new("int32_t *")
        tokens_ptr = lib.dflash_output_tokens(out[0], n)
        tokens = ffi.unpack(tokens_ptr, n[0]) if n[0] else []
        return generation.read_probs(out[0], tokens, first) or []

    def tokens(self, seq_id: int, first: int = 0) -> list[int]:
        """Tokens a live or finished sequence has committed so far, from ``first`` on."""
        out = ffi.new("const dflash_output **")
        check(lib.dflash_scheduler_peek(self._h(), seq_id, out))
        n = ffi.new("int32_t *")
        ptr = lib.dflash_output_tokens(out[0], n)
        return list(ffi.unpack(ptr + first, n[0] - first)) if n[0] > first else []  # only the new ones: per piece

    # -- slot files (llama-server's /slots/{id}?action=save|restore|erase) ------------------------

    def slot_save(self, slot: int, path: str | os.PathLike) -> tuple[int, int]:
        """Write an idle slot's KV and tokens to ``path``: (tokens, bytes). BusyError while the
        slot runs a request."""
        n_tokens, n_bytes = ffi.new("int32_t *"), ffi.new("size_t *")
        check(lib.dflash_scheduler_slot_save(self._h(), slot, os.fsencode(path), n_tokens, n_bytes))
        return int(n_tokens[0]), int(n_bytes[0])

    def slot_restore(self, slot: int, path: str | os.PathLike) -> tuple[int, int]:
        """Load a slot file into an idle slot (its KV then serves ``cache_prompt``): (tokens, bytes)."""
        n_tokens, n_bytes = ffi.new("int32_t *"), ffi.new("size_t *")
        check(lib.dflash_scheduler_slot_restore(self._h(), slot, os.fsencode(path), n_tokens, n_bytes))
        return int(n_tokens[0]), int(n_bytes[0])

    def slot_erase(self, slot: int) -> int:
        """Forget an idle slot's KV; returns the number of tokens dropped."""
        n_tokens = ffi.new("int32_t *")
        check(lib.dflash_scheduler_slot_erase(self._h(), slot, n_tokens))
        return int(n_tokens[0])

    def run(self, seq_ids: Sequence[int]) -> list[Result]:
        """Step until every sequence of ``seq_ids`` finished; their results in that order. On an
        error the sequences are cancelled and dropped."""
        wanted = set(seq_ids)
        try:
            while not wanted.issubset(self.finished()):
                self.step()
        except BaseException:
            self.abandon(seq_ids)
            raise
        return [self.take(i) for i in seq_ids]

    def abandon(self, seq_ids: Sequence[int]) -> None:
        """Cancel sequences and drop their results (cleanup after an error)."""
        if self._handle is None:
            return
        for i in seq_ids:
            if lib.dflash_scheduler_cancel(self._handle, i) != lib.DFLASH_OK:
                continue
            info = ffi.new("dflash_step_info *")
            for _ in range(2):  # a cancelled sequence finishes at the next step
                if i in self.finished():
                    break
                if lib.dflash_scheduler_step(self._handle, info) != lib.DFLASH_OK:
                    break
            out = ffi.new("dflash_output **")
            if lib.dflash_scheduler_take(self._handle, i, out) == lib.DFLASH_OK:
                lib.dflash_output_free(out[0])
            self._callbacks.pop(i, None)
            self._failures.pop(i, None)

    # -- state -------------------------------------------------------------------------------------

    def slot(self, index: int) -> SlotInfo:
        info = ffi.new("dflash_slot_info *")
        check(lib.dflash_scheduler_slot_info(self._h(), index, info))
        return SlotInfo(id=info.id, state=_SLOT_STATES.get(info.state, "idle"), n_prompt=info.n_prompt,
                        n_prefilled=info.n_prefilled, n_generated=info.n_generated, n_past=info.n_past,
                        n_cached=info.n_cached, n_prompt_cached=info.n_prompt_cached)

    @property
    def n_slots(self) -> int:
        return self.target.info.n_seq_max

    def tuning(self) -> dict[str, list[float]]:
        """What auto mode learned (costs by rows / width, acceptance counts by position)."""
        t = ffi.new("dflash_tuning *")
        check(lib.dflash_scheduler_get_tuning(self._h(), t))
        return {name: [float(x) for x in getattr(t, name)] for name in _TUNING_FIELDS}

    def fix_costs(self, t_rows_ms: Sequence[float], t_draft_ms: Sequence[float]) -> None:
        """Price auto's decisions with these costs instead of measured ones (tests, reproducible
        runs): ``t_rows_ms[r - 1]`` a target step of r rows, ``t_draft_ms[w - 1]`` a drafter block of
        width w. Timings are no longer learned (acceptance still is)."""
        rows = [float(x) for x in t_rows_ms]
        drafts = [float(x) for x in t_draft_ms]
        check(lib.dflash_scheduler_fix_costs(self._h(), ffi.new("float[]", rows) if rows else ffi.NULL, len(rows),
                                             ffi.new("float[]", drafts) if drafts else ffi.NULL, len(drafts)))

    def set_tuning(self, state: dict) -> None:
        """Start auto mode from a ``tuning()`` taken earlier (e.g. by another process)."""
        t = ffi.new("dflash_tuning *")
        for name in _TUNING_FIELDS:
            values = state.get(name, [])
            dst = getattr(t, name)
            if not isinstance(values, list) or len(values) > len(dst):
                raise errors.InvalidArgumentError(f"tuning field {name!r} must be a list of at most {len(dst)} numbers")
            for i, v in enumerate(values):
                if not isinstance(v, (int, float)):
                    raise errors.InvalidArgumentError(f"tuning field {name!r} holds a non-number")
                dst[i] = float(v)
        check(lib.dflash_scheduler_set_tuning(self._h(), t))
