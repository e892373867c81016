"""Prometheus counters: llama-server's (``llamacpp:``) plus the scheduler's own (``pydflash:``).

Written by the step loop and by embedding requests (under one lock), read by ``/metrics`` on the
event loop.

The two throughput gauges are llama-server's: averaged over the window since the previous scrape
(a scrape empties the window), and a generation's rate counts its tokens after the first (that one
comes free from the prompt's logits).

llama-server's definitions: ``prompt_tokens_total`` prompt tokens prefilled (cached ones are
``prompt_tokens_cached_total``), ``n_decode_total`` target batches decoded (steps),
``n_busy_slots_per_decode`` sequences per step. pydflash's: ``steps_total``, ``rows_per_step``
(target rows per step: every decoding sequence's anchor + drafts, plus prompt chunks of new
ones; a summary), ``sequences_per_step`` (decoding sequences per step; a summary),
``draft_width_steps_total{width="k"}`` (steps that decoded, by the draft width the scheduler
chose: 0 = plain), ``probe_steps_total`` (auto mode re-probing speculation).
"""

from __future__ import annotations

import threading
from typing import Any

from .answers import generation_steps, prefilled, verif_steps

__all__ = ["Metrics"]


class Metrics:
    def __init__(self) -> None:
        # per finished request
        self.prompt_tokens = 0
        self.prompt_tokens_cached = 0
        self.prompt_seconds = 0.0
        self.predicted_tokens = 0
        self.predicted_seconds = 0.0
        self.n_draft = 0
        self.n_accepted = 0
        self.n_drafts = 0
        self.accepted_per_pos = [0] * 16
        self.n_requests = 0
        self.n_tokens_max = 0
        # per step
        self.n_steps = 0
        self.n_decode = 0
        self.rows_sum = 0
        self.prefill_rows = 0
        self.sequences_sum = 0
        self.probe_steps = 0
        self.width_steps: dict[int, int] = {}
        self.last_width = 0
        # the scrape window of the throughput gauges: [prompt tokens, prompt s, generation steps, generation s]
        self._window = [0, 0.0, 0, 0.0]
        self._lock = threading.Lock()

    def add_result(self, stats: Any) -> None:
        with self._lock:
            self._add_result(stats)

    def _add_result(self, stats: Any) -> None:
        self.n_requests += 1
        n_prompt, prompt_s = prefilled(stats), stats.t_prefill_ms / 1e3
        predicted_s = max(stats.t_total_ms - stats.t_prefill_ms, 0.0) / 1e3
        self.prompt_tokens += n_prompt
        self.prompt_tokens_cached += stats.n_cached
        self.prompt_seconds += prompt_s
        self.predicted_tokens += stats.n_generated
        self.predicted_seconds += predicted_s
        w = self._window
        w[0] += n_prompt
        w[1] += prompt_s
        w[2] += generation_steps(stats.n_generated)
        w[3] += predicted_s
        self.n_draft += stats.n_drafted
        self.n_accepted += stats.n_accepted
        self.n_drafts += verif_steps(stats)
        for i, n in enumerate(stats.accepted_per_position[:16]):
            self.accepted_per_pos[i] += n
        self.n_tokens_max = max(self.n_tokens_max, stats.n_prompt + stats.n_generated)

    def add_embedding(self, n_tokens: int, seconds: float) -> None:
        """An embedding request's prompt: prefilled tokens and one target batch, nothing predicted."""
        with self._lock:
            self.prompt_tokens += n_tokens
            self.prompt_seconds += seconds
            self.n_decode += 1
            self._window[0] += n_tokens
            self._window[1] += seconds

    def add_step(self, info: Any) -> None:
        with self._lock:
            self._add_step(info)

    def _add_step(self, info: Any) -> None:
        self.n_steps += 1
        if info.n_rows <= 0:
            return
        self.n_decode += 1
        self.rows_sum += info.n_rows
        self.prefill_rows += info.n_prefill_rows
        self.sequences_sum += info.n_decoding
        self.probe_steps += bool(info.probe)
        if info.n_decoding:
            self.width_steps[info.width] = self.width_steps.get(info.width, 0) + 1
            self.last_width = info.width

    def take_window(self) -> tuple[float, float]:
        """(prompt tokens/s, generation tokens/s) since the previous call, which empties the window."""
        with self._lock:
            n_prompt, t_prompt, n_gen, t_gen = self._window
            self._window = [0, 0.0, 0, 0.0]
        return (n_prompt / t_prompt if t_prompt > 0 else 0.0, n_gen / t_gen if t_gen > 0 else 0.0)

    def render(self, processing: int, deferred: int, n_pos: int) -> str:
        """The Prometheus text; a scrape, so it empties the throughput window."""
        prompt_rate, predicted_rate = self.take_window()
        counters = [
            ("prompt_tokens_total", "Number of prompt tokens processed.", self.prompt_tokens),
            ("prompt_tokens_cached_total", "Number of prompt tokens reused from the prompt cache.",
             self.prompt_tokens_cached),
            ("prompt_seconds_total", "Total time spent processing prompts.", self.prompt_seconds),
            ("tokens_predicted_total", "Number of generation tokens processed.", self.predicted_tokens),
            ("tokens_predicted_seconds_total", "Total time spent generating tokens.", self.predicted_seconds),
            ("n_decode_total", "Total number of llama_decode() calls (target batches).", self.n_decode),
            ("n_tokens_max", "Largest observed sequence length (prompt + generation).", self.n_tokens_max),
            ("spec_decode_num_draft_tokens_total", "Speculative: Total draft tokens generated", self.n_draft),
            ("spec_decode_num_accepted_tokens_total", "Speculative: Total draft tokens accepted by the target model",
             self.n_accepted),
            ("spec_decode_num_drafts_total", "Speculative: Total speculative decoding verification steps",
             self.n_drafts),
        ]
        gauges = [
            ("prompt_tokens_seconds", "Average prompt throughput in tokens/s (since the previous scrape).",
             prompt_rate),
            ("predicted_tokens_seconds", "Average generation throughput in tokens/s (since the previous scrape).",
             predicted_rate),
            ("requests_processing", "Number of requests processing.", processing),
            ("requests_deferred", "Number of requests deferred.", deferred),
            ("n_busy_slots_per_decode", "Average number of busy slots per llama_decode() call.",
             self.sequences_sum / self.n_decode if self.n_decode else 0.0),
        ]
        ours = [
            ("requests_total", "Requests finished (cancelled ones included).", self.n_requests),
            ("steps_total", "Scheduler steps.", self.n_steps),
            ("prefill_rows_total", "Prompt rows decoded (chunks of new requests inside the steps).", self.prefill_rows),
            ("probe_steps_total", "Steps in which auto mode re-probed speculation.", self.probe_steps),
        ]
        lines = []
        for prefix, kind, items in (("llamacpp", "counter", counters), ("llamacpp", "gauge", gauges),
                                    ("pydflash", "counter", ours)):
            for name, help_, value in items:
                lines += [f"# HELP {prefix}:{name} {help_}", f"# TYPE {prefix}:{name} {kind}",
                          f"{prefix}:{name} {value}"]
        lines += ["# HELP llamacpp:spec_decode_num_accepted_tokens_per_pos_total Accepted tokens per draft position",
                  "# TYPE llamacpp:spec_decode_num_accepted_tokens_per_pos_total counter"]
        for i in range(n_pos):
            lines.append(f'llamacpp:spec_decode_num_accepted_tokens_per_pos_total{{position="{i}"}} '
                         f"{self.accepted_per_pos[i]}")
        for name, help_, total in (("rows_per_step", "Target rows per step (draft blocks + prompt chunks).",
                                    self.rows_sum),
                                   ("sequences_per_step", "Decoding sequences per step.", self.sequences_sum)):
            lines += [f"# HELP pydflash:{name} {help_}", f"# TYPE pydflash:{name} summary",
                      f"pydflash:{name}_sum {total}", f"pydflash:{name}_count {self.n_decode}"]
        lines += ["# HELP pydflash:draft_width_steps_total Steps by the draft width chosen (0: plain decoding).",
                  "# TYPE pydflash:draft_width_steps_total counter"]
        widths = dict(self.width_steps)  # a copy: the step loop may add a width meanwhile
        for width in sorted(widths):
            lines.append(f'pydflash:draft_width_steps_total{{width="{width}"}} {widths[width]}')
        return "\n".join(lines) + "\n"
