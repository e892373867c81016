"""The step loop: one thread owns the engine, and so its scheduler, for the server's whole life.

It loads the engine, then repeats until the server stops:

1. take the jobs and cancellations handed over since the last step (a thread-safe inbox; it
   sleeps on a condition while nothing runs),
2. cancel (``Scheduler.cancel``) the sequences of clients that left,
3. tokenize and check the new jobs' prompts against the slot's context (answering 400 from
   here) and add them to the scheduler (a seed drawn for each job that gives none),
4. run one ``Scheduler.step()``: it admits queued sequences to free slots (reusing the KV of a
   slot's longest common prompt prefix with ``cache_prompt``), drafts, and verifies every
   running sequence's block plus prompt chunks of the new ones in one target batch,
5. take the finished sequences, then hand every event of the step (streamed pieces, results,
   errors) to the event loop in one ``call_soon_threadsafe``.

With ``--sleep-idle-seconds``, the thread frees the target and the drafter once nothing has run
for that long (llama-server's sleeping state: the memory goes back to the machine) and loads them
again before the next job or engine call. Requests the HTTP side answers from the engine hold it
awake (``awake``); health, props, models and metrics read only what was published at load.

So a request joins the running batch at the next step (continuous batching), and requests with
different sampling options share steps (each sequence samples with its own options and seed).
Everything that touches the engine runs on this thread under the target's lock: the scheduler
is not thread-safe, and tokenizing in the HTTP handlers would wait behind a running step anyway.
The HTTP side reads only snapshots published after each step (``slots``, ``n_deferred``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import random
import sys
import threading
import time
import traceback
from collections.abc import Sequence
from typing import Any, NamedTuple

from ..runtime import devices
from ..runtime.generation import SamplingOptions
from ..runtime.scheduler import SlotInfo
from .command_line import ServerConfig, n_ctx_train
from ..runtime.chat import json_schema_to_grammar
from .metrics import Metrics
from .jobs import APIError, Job, Piece, Progress, Speculative, constraint_options, from_engine_error
from .answers import timings_of
from .text import detokenize, tokenize_mixed

__all__ = ["StepLoop", "SlotView"]


class SlotView(NamedTuple):
    info: SlotInfo
    job: Job | None


class StepLoop:
    """Runs the engine on its own thread; ``submit`` / ``cancel`` / ``stop`` are thread-safe."""

    def __init__(self, config: ServerConfig, metrics: Metrics, loop: asyncio.AbstractEventLoop) -> None:
        self.config = config
        self.metrics = metrics
        self.loop = loop
        self.engine: Any = None
        self.n_ctx_slot = 0
        self.loaded: concurrent.futures.Future = concurrent.futures.Future()
        # snapshots for the HTTP side, replaced after every step
        self.slots: tuple[SlotView, ...] = ()
        self.n_deferred = 0
        self._cond = threading.Condition()
        self._inbox: list[Job] = []       # guarded by _cond
        self._cancels: list[Job] = []     # guarded by _cond
        self._calls: list[tuple[Any, concurrent.futures.Future]] = []  # guarded by _cond
        self.chat: Any = None             # ChatTemplates (llama.cpp's Jinja engine), made at load
        self._eog: list[int] = []         # the target's end-of-generation tokens, found at load
        self._stopping = False            # guarded by _cond
        self.sleeping = False             # the models are freed (--sleep-idle-seconds); this thread writes it
        self._users = 0                   # HTTP requests holding the engine awake, guarded by _cond
        self._idle_since = time.monotonic()  # guarded by _cond
        self._live: dict[int, Job] = {}   # sequence id -> job, this thread only
        self._events: list[tuple[Job, str, Any]] = []  # this step's events, this thread only
        self._thread = threading.Thread(target=self._run, name="pydflash-step-loop", daemon=True)

    # -- the event loop's side ---------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def submit(self, jobs: Sequence[Job]) -> None:
        with self._cond:
            if not self._stopping:
                self._inbox.extend(jobs)
                self._cond.notify()
                return
        for job in jobs:  # on the event loop: answer at once
            job.put("error", APIError(503, "the server is shutting down"))

    def cancel(self, jobs: Sequence[Job]) -> None:
        """The clients of ``jobs`` left: stop their sequences at the next step."""
        for job in jobs:
            job.cancelled.set()
        with self._cond:
            self._cancels.extend(jobs)
            self._cond.notify()

    def call(self, fn) -> concurrent.futures.Future:  # type: ignore[no-untyped-def]
        """Run ``fn(engine)`` on this thread between two steps (what must not race the scheduler:
        slot files); the future holds its result or exception."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self._cond:
            if self._stopping:
                fut.set_exception(APIError(503, "the server is shutting down"))
                return fut
            self._calls.append((fn, fut))
            self._cond.notify()
        return fut

    @contextlib.asynccontextmanager
    async def awake(self):  # type: ignore[no-untyped-def]
        """Keep the engine loaded while the block runs, loading it first if it sleeps."""
        if self.config.sleep_idle_seconds < 0:  # it never sleeps: nothing to hold
            yield
            return
        with self._cond:
            self._users += 1
        try:
            if self.sleeping:
                await asyncio.wrap_future(self.call(lambda engine: None))  # the thread wakes before calls
            yield
        finally:
            with self._cond:
                self._users -= 1
                self._idle_since = time.monotonic()
                self._cond.notify()

    def stop(self) -> None:
        """Answer every unfinished job 503, free the engine, end the thread (see ``join``)."""
        with self._cond:
            self._stopping = True
            self._cond.notify()

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)

    def eog_tokens(self) -> list[int]:
        """The target's end-of-generation tokens (what ignore_eos biases away; found at load)."""
        return self._eog

    @property
    def n_processing(self) -> int:
        return sum(1 for v in self.slots if v.job is not None)

    def spec_of(self, job: Job | None) -> tuple[int, int, float]:
        """(n_max, n_min, p_min) a job runs with (None: the server's defaults). Under auto, n_max is
        the width the job decoded with most often (the server's: the latest step's)."""
        engine = self.engine
        if engine is None or engine.drafter is None:
            return 0, 0, 0.0
        spec = job.spec if job is not None else Speculative()
        if spec.n_max is not None:
            n_max = min(spec.n_max, max(engine.drafter.info.block_size - 1, 1))
        elif not engine.auto_n_max:
            n_max = engine.n_max
        elif job is not None:
            widths = dict(job.widths)  # a copy: this thread may be counting meanwhile
            n_max = max(widths, key=lambda w: (widths[w], w)) if widths else 0
        else:
            n_max = self.metrics.last_width
        n_min = engine.n_min if spec.n_min is None else spec.n_min
        return n_max, min(n_min, n_max), engine.p_min if spec.p_min is None else spec.p_min

    # -- the thread ----------------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._load()
        except BaseException as exc:  # noqa: BLE001 - reported by the server, which exits
            self.loaded.set_exception(exc)
            return
        self.loaded.set_result(None)
        try:
            while self._round():
                pass
        finally:
            self._shutdown()

    def _round(self) -> bool:
        """``_iterate``, surviving a bug in it: the thread must keep serving (a dead step loop
        would leave every later request waiting forever), so the running jobs are answered 500,
        their sequences dropped, and the loop goes on."""
        try:
            return self._iterate()
        except Exception as exc:  # noqa: BLE001 - a server bug, logged; the jobs it hit are answered
            err = from_engine_error(exc)
            try:
                if self.engine is not None and not self.sleeping:
                    with self.engine.target.lock:
                        self._fail_live(err)
                        self._snapshot()
                self._flush()
            except Exception:  # noqa: BLE001
                traceback.print_exc()
            time.sleep(0.01)  # no busy loop on a persistent failure
            return True

    def _load(self, warmup: bool | None = None) -> None:
        from ..runtime.engine import Engine

        c = self.config
        n_ctx_total = c.n_ctx_total or n_ctx_train(c.model)
        devices.add_rpc_servers(c.rpc)
        engine = Engine(c.model, c.drafter, n_ctx=max(n_ctx_total // c.n_slots, 16), n_threads=c.n_threads,
                        n_gpu_layers=c.n_gpu_layers, n_max=c.n_max, n_min=c.n_min, p_min=c.p_min,
                        lookup=c.lookup, n_seq_max=c.n_slots, n_batch=c.n_batch, drafter_device=c.device_draft, verbose=c.verbose)
        try:
            self.n_ctx_slot = engine.target.info.n_ctx
            self.chat = self._chat_templates(engine.target)
            target = engine.target
            self._eog = [t for t in range(target.info.n_vocab) if target.is_eog(t)]
            if c.warmup if warmup is None else warmup:  # one short generation on every slot
                bos = max(engine.target.info.token_bos, 0)
                engine.generate_batch([[bos]] * c.n_slots, max_tokens=2, temperature=0, ignore_eos=True)
                with engine.target.lock:
                    for i in range(c.n_slots):  # the prompt caches start empty (the scheduler sees it)
                        engine.target.rollback(0, seq_id=i)
        except BaseException:
            engine.close()
            raise
        self.engine = engine
        print(f"pydflash serve: {describe_speculation(engine)}", file=sys.stderr, flush=True)
        with engine.target.lock:
            self._snapshot()

    def _chat_templates(self, target):  # type: ignore[no-untyped-def]
        """llama-server's --jinja / --chat-template(-file) / --reasoning* / --chat-template-kwargs."""
        from ..runtime.chat import ChatTemplates

        c = self.config
        template = c.chat_template
        if c.chat_template_file:
            with open(c.chat_template_file, encoding="utf-8") as f:
                template = f.read()
        return ChatTemplates(target, template=template, use_jinja=c.jinja, reasoning=c.reasoning,
                             reasoning_format=c.reasoning_format, chat_template_kwargs=c.chat_template_kwargs)

    def _has_work(self) -> bool:  # under _cond
        return bool(self._inbox or self._cancels or self._stopping or self._live or self._calls)

    def _until_sleep(self) -> float | None:  # under _cond
        """Seconds until the engine may sleep; None while it cannot (disabled, asleep, in use)."""
        idle = self.config.sleep_idle_seconds
        if idle < 0 or self.sleeping or self._users or self._live:
            return None
        return self._idle_since + idle - time.monotonic()

    def _iterate(self) -> bool:
        """One round: inbox, one step, events. False once the server stops."""
        with self._cond:
            while not self._has_work():
                wait = self._until_sleep()
                if wait is not None and wait <= 0:
                    break
                self._cond.wait(wait)
            if self._stopping:
                return False
            idle = not self._has_work()
            if idle:  # for --sleep-idle-seconds: decided under the lock, so that a request taking the
                self.sleeping = True  # engine from now on waits for the wake-up
            new, self._inbox = self._inbox, []
            cancels, self._cancels = self._cancels, []
            calls, self._calls = self._calls, []
        if idle:
            self._sleep()
            return True
        if self.sleeping and not self._wake(new, calls):
            return True
        stalled = False
        with self.engine.target.lock:
            for fn, fut in calls:
                try:
                    fut.set_result(fn(self.engine))
                except BaseException as exc:  # noqa: BLE001 - handed to the caller
                    fut.set_exception(exc)
            try:
                for job in cancels:
                    self._cancel(job)
                for job in new:
                    self._add(job)
                if self._live:
                    stalled = self._step()
            except Exception as exc:  # noqa: BLE001 - the running jobs fail (a bug: logged), the server keeps serving
                self._fail_live(from_engine_error(exc))
            self._snapshot()
        self._flush()
        with self._cond:
            self._idle_since = time.monotonic()
            if stalled:  # nothing could run this step: do not spin
                self._cond.wait(timeout=0.005)
        return True

    def _sleep(self) -> None:
        """Free the models (the closed objects keep the facts the HTTP side reads)."""
        engine = self.engine
        with engine.target.lock:
            if self.chat is not None:
                self.chat.close()
            engine.close()
        print(f"pydflash serve: idle for {self.config.sleep_idle_seconds:g} s, sleeping (models freed)",
              file=sys.stderr, flush=True)

    def _wake(self, new: list[Job], calls: list) -> bool:
        """Load the models again; on failure answer what was waiting 503 (and stay asleep)."""
        t0 = time.monotonic()
        try:
            self._load(warmup=False)
        except Exception as exc:  # noqa: BLE001 - the server keeps answering, and retries on the next job
            err = APIError(503, f"cannot load the model again after sleeping: {type(exc).__name__}: {exc}",
                           "unavailable_error")
            for _, fut in calls:
                fut.set_exception(err)
            for job in new:
                self._events.append((job, "error", err))
            self._flush()
            return False
        self.sleeping = False
        print(f"pydflash serve: awake, models loaded in {time.monotonic() - t0:.1f} s", file=sys.stderr, flush=True)
        return True

    def _add(self, job: Job) -> None:
        if job.cancelled.is_set():
            return
        try:
            tokens = self._tokens(job)
            seed = job.options["seed"] if job.options["seed"] is not None else random.getrandbits(32)
            constraints = self._constraints(job)
            job.logit_bias = list(constraints.get("logit_bias", ()))
            options = SamplingOptions.build(**{**job.options, **constraints, "seed": seed})
            sid = self.engine.scheduler.add(tokens, options, **self._spec_args(job.spec), slot=job.slot_request,
                                            cache_prompt=job.cache_prompt and self.config.cache_prompt,
                                            on_piece=functools.partial(self._on_piece, job))
        except Exception as exc:  # noqa: BLE001 - bad input: answered 4xx (anything else: a logged 500)
            self._events.append((job, "error", from_engine_error(exc)))
            return
        try:
            job.prompt_text = detokenize(self.engine.target, tokens)
        except Exception as exc:  # noqa: BLE001 - a sequence without its job must not keep a slot busy
            self.engine.scheduler.abandon([sid])
            self._events.append((job, "error", from_engine_error(exc)))
            return
        job.seq_id, job.seed, job.n_prompt = sid, seed, len(tokens)
        self._live[sid] = job
        job.t_start = time.monotonic()
        self._events.append((job, "start", len(tokens)))

    def _constraints(self, job: Job) -> dict:
        """Grammar, logit bias and n_probs of the request, parsed before it was queued (a chat
        request's grammar and extra stop words come from its template render)."""
        target = self.engine.target
        opts = constraint_options(job.constraints, target.info.n_vocab,
                                  lambda text: target.tokenize(text, add_special=False, parse_special=False))
        r = job.render
        if r is not None:
            if r.get("grammar") and not r.get("grammar_lazy"):
                opts["grammar"] = r["grammar"]  # the template's output format, after its generation prompt
                opts["grammar_prefix"] = r.get("generation_prompt") or None
            elif r.get("json_schema"):
                opts["grammar"] = json_schema_to_grammar(r["json_schema"])
            # else: the client's own grammar (in opts already), from the first token
            if r.get("additional_stops"):
                opts["stop"] = tuple(job.options["stop"]) + tuple(s for s in r["additional_stops"] if s)
        return opts

    def _cancel(self, job: Job) -> None:
        if job.seq_id in self._live:
            self.engine.scheduler.cancel(job.seq_id)

    def _step(self) -> bool:
        """One scheduler step; True when it could do nothing."""
        sched = self.engine.scheduler
        decoding = [v.job for v in self.slots if v.job is not None and v.info.state == "decode"]
        mark = len(self._events)
        info = sched.step()
        if any(j.return_progress for j in self._live.values()):
            self._events[mark:mark] = self._progress()
        self.metrics.add_step(info)
        if info.n_decoding:
            for job in decoding:
                job.widths[info.width] += 1
        done = sched.finished()
        for sid in done:
            self._finish(sid)
        return info.n_rows == 0 and not done

    def _progress(self) -> list[tuple[Job, str, Any]]:
        """Prompt progress of the jobs that asked (llama-server's ``prompt_progress``): one report
        when a job's slot starts it (processed = cached), then one per step that prefilled."""
        sched, events = self.engine.scheduler, []
        for i in range(sched.n_slots):
            info = sched.slot(i)
            job = self._live.get(info.id) if info.id else None
            if job is None or not job.return_progress:
                continue
            cache = info.n_prompt_cached
            ms = int((time.monotonic() - job.t_start) * 1e3)
            if job.progress[1] < 0:  # before any prompt token is decoded: no time spent yet
                timings = timings_of(cache, 0, 0.0, 0, 0.0) if job.timings_per_token else None
                events.append((job, "progress", Progress({"total": job.n_prompt, "cache": cache, "processed": cache,
                                                          "time_ms": ms}, timings)))
                job.progress = (cache, cache)
            processed = min(info.n_prefilled, job.n_prompt)
            if processed > job.progress[1]:
                timings = self._timings_so_far(job, info) if job.timings_per_token else None
                events.append((job, "progress", Progress({"total": job.n_prompt, "cache": cache,
                                                          "processed": processed, "time_ms": ms}, timings)))
                job.progress = (cache, processed)
        return events

    def _timings_so_far(self, job: Job, info: SlotInfo | None = None) -> dict:
        """A running job's ``timings`` (``timings_per_token``): the prompt part until its first
        piece, then the generation part."""
        if info is None:
            info = self._slot_info(job)
        now = time.monotonic()
        if info is None:
            return timings_of(0, 0, 0.0, 0, 0.0)
        cache = info.n_prompt_cached
        prompt_n = max(min(info.n_prefilled, job.n_prompt) - cache, 0)
        prompt_ms = ((job.t_prefilled or now) - job.t_start) * 1e3 if prompt_n else 0.0
        if not job.t_prefilled:
            return timings_of(cache, prompt_n, prompt_ms, 0, 0.0)
        return timings_of(cache, prompt_n, prompt_ms, info.n_generated, (now - job.t_prefilled) * 1e3)

    def _slot_info(self, job: Job) -> SlotInfo | None:
        """The slot a running job is in (the one it was last seen in, else a search)."""
        sched = self.engine.scheduler
        if job.slot >= 0:
            info = sched.slot(job.slot)
            if info.id == job.seq_id:
                return info
        for i in range(sched.n_slots):
            info = sched.slot(i)
            if info.id == job.seq_id:
                return info
        return None

    def _finish(self, sid: int) -> None:
        job = self._live.pop(sid, None)
        try:
            result = self.engine.scheduler.take(sid)
        except Exception as exc:  # noqa: BLE001
            if job is not None:
                self._events.append((job, "error", from_engine_error(exc)))
            return
        self.metrics.add_result(result.stats)
        if job is None or job.cancelled.is_set():
            return  # its client left
        if result.stats.stop_reason == "cancelled":
            self._events.append((job, "error", APIError(503, "generation cancelled")))
        else:
            self._events.append((job, "done", result))

    def _fail_live(self, err: APIError) -> None:
        jobs, self._live = self._live, {}
        for job in jobs.values():
            self._events.append((job, "error", err))
        self.engine.scheduler.abandon(list(jobs))

    def _on_piece(self, job: Job, text: str) -> bool:
        """Called inside a step for each piece of text a sequence commits; False stops it."""
        if job.cancelled.is_set():
            return False
        if "\n" in text:
            job.has_new_line = True
        if not job.t_prefilled:
            job.t_prefilled = time.monotonic()
        tokens: tuple[int, ...] = ()
        probs: tuple = ()
        if job.piece_tokens or job.constraints.probs_per_piece:
            # the tokens committed since the last piece, as the scheduler has them (and their
            # probabilities when asked for); a piece may carry several tokens or none
            sched = self.engine.scheduler
            new = sched.tokens(job.seq_id, job.n_seen)
            if new:
                probs = tuple(sched.probs(job.seq_id, job.n_seen))
                job.n_seen += len(new)
            tokens = tuple(new)
        timings = self._timings_so_far(job) if job.timings_per_token else None
        self._events.append((job, "piece", Piece(text, tokens, probs, timings)))
        return True

    def _flush(self) -> None:
        events, self._events = self._events, []
        if events:
            try:
                self.loop.call_soon_threadsafe(_deliver, events)
            except RuntimeError:  # the event loop is closed: nobody is listening
                pass

    def _snapshot(self) -> None:
        sched = self.engine.scheduler
        views = []
        for i in range(sched.n_slots):
            info = sched.slot(i)
            job = self._live.get(info.id) if info.id else None
            if job is not None:
                job.slot = i
            views.append(SlotView(info, job))
        self.slots = tuple(views)
        self.n_deferred = sum(1 for j in self._live.values() if j.slot < 0) + len(self._inbox)

    def _tokens(self, job: Job) -> list[int]:
        """The job's prompt tokens, checked against the vocabulary and the slot's context."""
        target = self.engine.target
        if job.kind == "chat":
            job.render, tokens = self.render_chat(job.template_input or {"messages": job.prompt})
        elif job.kind == "text":
            tokens = target.tokenize(job.prompt)
        elif job.kind == "mixed":  # as llama-server: BOS before a leading string, special tokens parsed
            tokens = tokenize_mixed(target, job.prompt, add_special=True, parse_special=True)
        else:
            tokens = list(job.prompt)
        bad = [t for t in tokens if not 0 <= t < target.info.n_vocab]
        if bad:
            raise APIError(400, f"token id {bad[0]} is outside the vocabulary (0..{target.info.n_vocab - 1})")
        if not tokens:
            raise APIError(400, "the prompt is empty")
        n_ctx = self.n_ctx_slot
        if len(tokens) >= n_ctx:
            raise APIError(400, f"the request ({len(tokens)} prompt tokens) exceeds the available context size "
                                f"({n_ctx} tokens per slot)", "exceed_context_size_error",
                           n_prompt_tokens=len(tokens), n_ctx=n_ctx)
        # max_tokens past the slot's context is not an error (as llama-server without context
        # shift): generation stops when the context is full, finish_reason "length", truncated
        return tokens

    def render_chat(self, template_input: dict) -> tuple[dict, list[int]]:
        """A chat job's template render and its prompt tokens (this thread owns the templates)."""
        render = self.chat.render(template_input)
        return render, self.engine.target.tokenize(render["prompt"], parse_special=True)

    def _spec_args(self, spec: Speculative) -> dict:
        """A job's speculative overrides as ``Scheduler.add`` arguments (validated as the Engine's)."""
        if self.engine.drafter is None:
            return {}
        return self.engine.spec_overrides(spec.n_max, spec.n_min, spec.p_min)

    def _shutdown(self) -> None:
        with self._cond:
            self._stopping = True
            inbox, self._inbox = self._inbox, []
            calls, self._calls = self._calls, []
        err = APIError(503, "the server is shutting down")
        for _, fut in calls:
            fut.set_exception(err)
        if self.chat is not None:
            self.chat.close()
        for job in inbox + list(self._live.values()):
            self._events.append((job, "error", err))
        engine = self.engine
        if engine is not None and self.sleeping:
            self._flush()
        elif engine is not None:
            with engine.target.lock:
                engine.scheduler.abandon(list(self._live))
                self._live.clear()
            self._flush()
            engine.close()


def _deliver(events: list[tuple[Job, str, Any]]) -> None:
    """On the event loop: one step's events, in order."""
    for job, kind, payload in events:
        job.put(kind, payload)


def describe_speculation(engine) -> str:  # type: ignore[no-untyped-def]
    """One line for the startup log: the drafter and width policy in use, how the target rolls
    rejected rows back, and why speculation is off where it is."""
    import os

    sched = engine.scheduler
    info = engine.target.info
    used = engine.drafter is not None and not (sched is not None and sched.notice)
    drafter = os.path.basename(engine.drafter.path) if used else "none"
    width = "auto" if engine.auto_n_max else f"n_max {engine.n_max}"
    lookup = sched.lookup if sched is not None else 0
    line = (f"drafter {drafter}, width {width}, history drafts {'on' if lookup else 'off'}, "
            f"rollback {info.rollback} (up to {info.n_verify_max} drafts), taps {info.tap_source}")
    if sched is not None and sched.notice:
        line += f"; note: {sched.notice}"
    return line

