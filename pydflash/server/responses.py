"""Response formats: llama.cpp's ``timings`` / ``generation_settings``, OpenAI's ``usage``, SSE.

Counter definitions (as llama-server's): ``cache_n`` prompt tokens reused from the slot's KV,
``prompt_n`` prompt tokens prefilled (the rest), ``draft_n`` drafted tokens, ``draft_n_accepted``
the accepted ones, ``draft_n_verif_steps`` the target verification steps of a request that
drafted at all (every step verifies one block per sequence).
"""

from __future__ import annotations

import json
import time
from typing import Any

__all__ = ["FINISH_REASONS", "STOP_TYPES", "SYSTEM_FINGERPRINT", "timings", "usage", "settings", "sse", "now",
           "verif_steps", "prefilled"]

FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length", "context": "length", "cancelled": "stop",
                  "none": "stop"}
STOP_TYPES = {"eos": "eos", "stop": "word", "length": "limit", "context": "limit", "cancelled": "none",
              "none": "none"}
SYSTEM_FINGERPRINT = "pydflash"


def now() -> int:
    return int(time.time())


def sse(data: Any) -> bytes:
    return b"data: " + json.dumps(data, ensure_ascii=False).encode() + b"\n\n"


def verif_steps(stats: Any) -> int:
    """Verification steps that checked a draft (the definition behind draft_n_verif_steps)."""
    return stats.n_verify_steps if stats.n_drafted > 0 else 0


def prefilled(stats: Any) -> int:
    """Prompt tokens decoded (the ones not reused from the slot's cache)."""
    return stats.n_prompt - stats.n_cached


def timings(stats: Any, speculative: bool) -> dict:
    """llama.cpp's ``timings`` object (the draft fields only when the server speculates, as upstream)."""
    predicted_ms = max(stats.t_total_ms - stats.t_prefill_ms, 0.0)
    n_prefilled = prefilled(stats)
    out = {
        "cache_n": stats.n_cached,
        "prompt_n": n_prefilled,
        "prompt_ms": stats.t_prefill_ms,
        "prompt_per_token_ms": stats.t_prefill_ms / n_prefilled if n_prefilled else 0.0,
        "prompt_per_second": 1e3 * n_prefilled / stats.t_prefill_ms if stats.t_prefill_ms > 0 else 0.0,
        "predicted_n": stats.n_generated,
        "predicted_ms": predicted_ms,
        "predicted_per_token_ms": predicted_ms / stats.n_generated if stats.n_generated else 0.0,
        "predicted_per_second": 1e3 * stats.n_generated / predicted_ms if predicted_ms > 0 else 0.0,
    }
    if speculative:
        out.update(draft_n=stats.n_drafted, draft_n_accepted=stats.n_accepted, draft_n_verif_steps=verif_steps(stats))
    return out


def usage(results: list) -> dict:
    """OpenAI's ``usage``: whole prompts (cached tokens included, and counted apart)."""
    prompt = sum(r.stats.n_prompt for r in results)
    completion = sum(r.stats.n_generated for r in results)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(r.stats.n_cached for r in results)}}


def settings(options: dict, n_max: int, n_min: int, p_min: float, speculative: bool) -> dict:
    """llama.cpp's ``generation_settings`` / a slot's ``params`` (the fields pydflash has)."""
    o = options
    seed = o.get("seed")
    return {
        "n_predict": o.get("max_tokens", -1), "max_tokens": o.get("max_tokens", -1),
        "temperature": o.get("temperature", 0.8), "top_k": o.get("top_k", 40), "top_p": o.get("top_p", 0.95),
        "min_p": o.get("min_p", 0.05), "seed": -1 if seed is None else seed, "stop": list(o.get("stop", ())),
        "ignore_eos": o.get("ignore_eos", False),
        "speculative.n_max": n_max, "speculative.n_min": n_min, "speculative.p_min": p_min,
        "speculative.types": "draft-dflash" if speculative else "none",
    }
