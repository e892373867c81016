"""Answer shapes every API family shares: llama.cpp's ``timings`` / ``generation_settings``, OpenAI's
``usage``, finish reasons, SSE framing, ids.

Counter definitions (as llama-server's): ``cache_n`` prompt tokens reused from the slot's KV,
``prompt_n`` prompt tokens prefilled (the rest), ``draft_n`` drafted tokens, ``draft_n_accepted``
the accepted ones, ``draft_n_verif_steps`` the target verification steps of a request that
drafted at all (every step verifies one block per sequence).
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from .. import __version__

__all__ = ["FINISH_REASONS", "STOP_TYPES", "SYSTEM_FINGERPRINT", "generation_steps", "timings", "timings_of", "usage",
           "settings", "sse", "now", "random_id", "timed", "verif_steps", "prefilled", "nested_fields"]

FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length", "context": "length", "cancelled": "stop",
                  "none": "stop"}
STOP_TYPES = {"eos": "eos", "stop": "word", "length": "limit", "context": "limit", "cancelled": "none",
              "none": "none"}
# llama-server's is its build, "b<number>-<commit>"; ours keeps the shape
SYSTEM_FINGERPRINT = f"b{__version__}-pydflash"


def now() -> int:
    return int(time.time())


def random_id() -> str:
    return uuid.uuid4().hex


def timed(msg: dict, timings: dict | None) -> dict:
    """A streamed message with the timings so far (``timings_per_token``), as llama-server's."""
    if timings is not None:
        msg["timings"] = timings
    return msg


def sse(data: Any) -> bytes:
    """One server-sent event: a dict as ``data:``, an (event name, dict) pair with its ``event:`` line."""
    if isinstance(data, tuple):
        name, data = data
        return f"event: {name}\n".encode() + sse(data)
    return b"data: " + json.dumps(data, ensure_ascii=False).encode() + b"\n\n"


def verif_steps(stats: Any) -> int:
    """Verification steps that checked a draft (the definition behind draft_n_verif_steps)."""
    return stats.n_verify_steps if stats.n_drafted > 0 else 0


def prefilled(stats: Any) -> int:
    """Prompt tokens decoded (the ones not reused from the slot's cache)."""
    return stats.n_prompt - stats.n_cached


def generation_steps(n_generated: int) -> int:
    """The tokens a generation's rate counts, as llama-server's: the first one is free (it comes
    from the prompt's last logits), so one token is no rate at all."""
    return max(n_generated - 1, 0)


def timings_of(cache_n: int, prompt_n: int, prompt_ms: float, predicted_n: int, predicted_ms: float) -> dict:
    """llama.cpp's ``timings`` object from its counts and times (a generation's rate leaves out
    its first token, see ``generation_steps``)."""
    n_steps = generation_steps(predicted_n)
    return {
        "cache_n": cache_n,
        "prompt_n": prompt_n,
        "prompt_ms": prompt_ms,
        "prompt_per_token_ms": prompt_ms / prompt_n if prompt_n else 0.0,
        "prompt_per_second": 1e3 * prompt_n / prompt_ms if prompt_n and prompt_ms > 0 else 0.0,
        "predicted_n": predicted_n,
        "predicted_ms": predicted_ms,
        "predicted_per_token_ms": predicted_ms / n_steps if n_steps else 0.0,
        "predicted_per_second": 1e3 * n_steps / predicted_ms if n_steps and predicted_ms > 0 else 0.0,
    }


def timings(stats: Any, speculative: bool) -> dict:
    """llama.cpp's ``timings`` object (the draft fields only when the server speculates, as upstream)."""
    out = timings_of(stats.n_cached, prefilled(stats), stats.t_prefill_ms, stats.n_generated,
                     max(stats.t_total_ms - stats.t_prefill_ms, 0.0))
    if speculative:
        out.update(draft_n=stats.n_drafted, draft_n_accepted=stats.n_accepted, draft_n_verif_steps=verif_steps(stats))
    return out


def usage(results: list) -> dict:
    """OpenAI's ``usage``: whole prompts (cached tokens included, and counted apart)."""
    prompt = sum(r.stats.n_prompt for r in results)
    completion = sum(r.stats.n_generated for r in results)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(r.stats.n_cached for r in results)}}


def settings(options: dict, n_max: int, n_min: int, p_min: float, speculative: bool,
             logit_bias: list | None = None, eog: list[int] | None = None) -> dict:
    """llama.cpp's ``generation_settings`` / a slot's ``params`` (the fields pydflash has).
    ``logit_bias``: the (token, bias) pairs sampled with; under ignore_eos the ``eog`` tokens are
    listed too, at -inf (JSON null, as llama-server writes it)."""
    o = options
    seed = o.get("seed")
    bias = [{"bias": None if b == float("-inf") else float(b), "token": int(t)} for t, b in (logit_bias or ())]
    if o.get("ignore_eos"):
        bias += [{"bias": None, "token": int(t)} for t in (eog or ())]
    return {
        "n_predict": o.get("max_tokens", -1), "max_tokens": o.get("max_tokens", -1),
        "temperature": o.get("temperature", 0.8), "top_k": o.get("top_k", 40), "top_p": o.get("top_p", 0.95),
        "min_p": o.get("min_p", 0.05), "seed": -1 if seed is None else seed, "stop": list(o.get("stop", ())),
        "ignore_eos": o.get("ignore_eos", False), "logit_bias": bias,
        # samplers pydflash does not have, at the values that switch them off in llama.cpp
        "dynatemp_range": 0.0, "dynatemp_exponent": 1.0, "top_n_sigma": -1.0, "xtc_probability": 0.0,
        "xtc_threshold": 0.1, "typical_p": 1.0, "repeat_last_n": 64, "repeat_penalty": 1.0,
        "presence_penalty": 0.0, "frequency_penalty": 0.0, "dry_multiplier": 0.0, "dry_base": 1.75,
        "dry_allowed_length": 2, "dry_penalty_last_n": 64, "mirostat": 0, "mirostat_tau": 5.0, "mirostat_eta": 0.1,
        "adaptive_target": -1.0, "adaptive_decay": 0.9, "n_keep": 0, "n_discard": 0, "n_probs": 0, "min_keep": 0,
        "speculative.n_max": n_max, "speculative.n_min": n_min, "speculative.p_min": p_min,
        "speculative.types": "draft-dflash" if speculative else "none",
    }


def nested_fields(paths: list[str], data: dict) -> dict:
    """llama.cpp's ``response_fields``: only these fields, a "a/b" path lifted to the top level
    under its path; paths that do not resolve are left out."""
    out = {}
    for path in paths:
        cur: Any = data
        for key in path.split("/"):
            if not isinstance(cur, dict) or key not in cur:
                break
            cur = cur[key]
        else:
            out[path] = cur
    return out
