"""Tokenizer helpers behind ``/tokenize``, ``/detokenize`` and llama.cpp's prompt forms.

A completion prompt, as llama-server takes it, is a string, a list of token ids, a *mixed* list
(strings and ids in one sequence: the strings are tokenized in place, and only a first string
gets the BOS), or an object ``{"prompt_string": ..., "multimodal_data": [...]}``. Every
function here runs under the target's lock (the step loop holds it for a whole step, so a call
from another thread waits for the running step to end).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["tokenize_mixed", "token_bytes", "piece_json", "detokenize"]


def tokenize_mixed(target: Any, pieces: Sequence[str | int], *, add_special: bool, parse_special: bool) -> list[int]:
    """Strings tokenized in place, ids kept; BOS (``add_special``) only when the first piece is text."""
    out: list[int] = []
    for i, piece in enumerate(pieces):
        if isinstance(piece, str):
            out += target.tokenize(piece, add_special=add_special and i == 0, parse_special=parse_special)
        else:
            out.append(int(piece))
    return out


def token_bytes(target: Any, tokens: Sequence[int]) -> bytes:
    """The raw UTF-8 bytes of the tokens' pieces, special tokens rendered (no lossy decoding)."""
    if not tokens:
        return b""
    bad = [t for t in tokens if not 0 <= t < target.info.n_vocab]
    if bad:
        from .jobs import APIError
        raise APIError(400, f"token id {bad[0]} is outside the vocabulary (0..{target.info.n_vocab - 1})")
    return target.detokenize_bytes(tokens, render_special=True)


def piece_json(target: Any, token: int) -> str | list[int]:
    """One token's piece: its text when it is valid UTF-8, else its bytes (as llama-server)."""
    raw = token_bytes(target, [token])
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return list(raw)


def detokenize(target: Any, tokens: Sequence[int]) -> str:
    """The text of the tokens, concatenated piece by piece (special tokens rendered)."""
    return token_bytes(target, tokens).decode("utf-8", "replace")
