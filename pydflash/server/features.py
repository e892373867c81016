"""Request features that need the model: constraints (grammar, JSON schema, logit bias), token
probabilities, fill-in-the-middle prompts and embeddings - parsed and formatted as llama-server
does. The work itself is native (``pydflash.runtime.chat``, ``SamplingOptions``, ``Target.embed``).
"""

from __future__ import annotations

import base64
import math
import struct
from typing import Any, Sequence

import numpy as np

from .. import errors
from ..runtime.chat import json_schema_to_grammar
from .jobs import APIError, Constraints, client_input

__all__ = ["constraint_options", "parse_constraints", "probs_json", "oai_logprobs", "infill_tokens", "check_infill",
           "embedding_rows", "normalize"]


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _schema_grammar(schema: Any) -> str:
    try:
        return json_schema_to_grammar(schema)
    except errors.InvalidArgumentError as exc:
        raise APIError(400, str(exc)) from None


def _logit_bias(value: Any) -> tuple[tuple[int | str, float], ...]:
    """llama-server's forms: {"id": bias} (OpenAI), [[id, bias], ...], [["text", bias], ...];
    a bias of false bans the token. Texts stay texts (the step loop tokenizes them)."""
    pairs: list[tuple[Any, Any]]
    if isinstance(value, dict):
        pairs = list(value.items())
    elif isinstance(value, list):
        pairs = []
        for item in value:
            if not isinstance(item, list) or len(item) != 2:
                raise APIError(400, "'logit_bias' entries must be [token or text, bias] pairs")
            pairs.append((item[0], item[1]))
    else:
        raise APIError(400, "'logit_bias' must be an object or a list of [token, bias] pairs")
    out: list[tuple[int | str, float]] = []
    for key, bias in pairs:
        if bias is False:
            b = -math.inf
        elif isinstance(bias, (int, float)) and not isinstance(bias, bool) and math.isfinite(bias):
            b = float(bias)
        else:
            raise APIError(400, f"a logit bias must be a number or false, got {str(bias)[:80]}")
        if isinstance(key, str) and not key.lstrip("-").isdigit():
            out.append((key, b))  # a text: every one of its tokens
            continue
        try:
            out.append((int(key), b))
        except (TypeError, ValueError, OverflowError):
            raise APIError(400, f"'logit_bias' key {str(key)[:80]} is not a token id") from None
    return tuple(out)


@client_input
def parse_constraints(body: dict, *, chat: bool = False) -> Constraints:
    """``grammar`` / ``json_schema`` / ``response_format`` (completion endpoints: converted to GBNF
    here; a chat request's come from its template render, its own ``grammar`` is the fallback),
    ``logit_bias``, ``n_probs`` / ``logprobs`` / ``top_logprobs`` and ``post_sampling_probs``."""
    grammar = body.get("grammar")
    if grammar is not None and not isinstance(grammar, str):
        raise APIError(400, "'grammar' must be a string")
    grammar = grammar or None
    if not chat:
        schema = body.get("json_schema")
        if schema is not None and grammar:
            raise APIError(400, "Cannot use both json_schema and grammar")
        rf = body.get("response_format")
        if isinstance(rf, dict) and schema is None:
            kind = rf.get("type")
            if kind == "json_object":
                schema = rf.get("schema") or {"type": "object"}
            elif kind == "json_schema":
                inner = rf.get("json_schema") or {}
                if not isinstance(inner, dict):
                    raise APIError(400, "'response_format.json_schema' must be an object")
                schema = inner.get("schema") or {"type": "object"}
            elif kind not in (None, "text"):
                raise APIError(400, f'response_format type must be one of "text" or "json_object", but got: '
                                    f'{str(kind)[:80]}')
        if schema is not None:
            if isinstance(schema, dict) and not schema:
                schema = {"type": "object"}
            grammar = _schema_grammar(schema)
    bias = _logit_bias(body["logit_bias"]) if body.get("logit_bias") is not None else ()
    n_probs = body.get("n_probs")
    if chat:
        if body.get("logprobs"):
            n_probs = body.get("top_logprobs")
            n_probs = 20 if n_probs is None else n_probs
        elif body.get("top_logprobs") is not None:
            raise APIError(400, "top_logprobs requires logprobs to be set to true")
    elif body.get("logprobs") is not None and n_probs is None and _is_int(body.get("logprobs")):
        n_probs = body["logprobs"]  # OpenAI /v1/completions: logprobs = number of candidates
    if n_probs is not None and (not _is_int(n_probs) or n_probs < 0):
        raise APIError(400, "'n_probs' must be an int >= 0")
    # llama-server reports the chosen token even with n_probs 0 once probabilities are asked for
    post = body.get("post_sampling_probs")
    if post is not None and not isinstance(post, bool):
        raise APIError(400, "'post_sampling_probs' must be a boolean")
    return Constraints(grammar=grammar, logit_bias=bias, n_probs=n_probs, post_sampling_probs=post,
                       probs_per_piece=bool(body.get("n_probs")) or bool(body.get("logprobs")))


def constraint_options(c: Constraints, n_vocab: int, tokenize) -> dict:  # type: ignore[no-untyped-def]
    """SamplingOptions keywords of parsed constraints (on the step loop: texts of ``logit_bias``
    tokenized, ids outside the vocabulary left out as llama-server does, ``n_probs`` clamped)."""
    opts: dict[str, Any] = {}
    if c.grammar:
        opts["grammar"] = c.grammar
    if c.logit_bias:
        bias: list[tuple[int, float]] = []
        for key, b in c.logit_bias:
            bias += [(t, b) for t in (tokenize(key) if isinstance(key, str) else [key]) if 0 <= t < n_vocab]
        opts["logit_bias"] = bias
    if c.n_probs is not None:
        opts["n_probs"] = min(c.n_probs, n_vocab)
    if c.post_sampling_probs is not None:
        opts["post_sampling_probs"] = c.post_sampling_probs
    return opts


def _piece(detok, token: int) -> tuple[str, list[int]]:  # type: ignore[no-untyped-def]
    raw = detok(token)
    return raw.decode("utf-8", "replace"), list(raw)


def probs_json(probs: Sequence[Any], detok, post: bool) -> list[dict]:  # type: ignore[no-untyped-def]
    """llama-server's ``completion_probabilities``: per token {id, token, bytes, logprob,
    top_logprobs} (post-sampling: prob / top_probs)."""
    out = []
    for tp in probs:
        text, raw = _piece(detok, tp.token)
        entry: dict[str, Any] = {"id": tp.token, "token": text, "bytes": raw}
        tops = []
        for t, lp in tp.top:
            tt, tr = _piece(detok, t)
            tops.append({"id": t, "token": tt, "bytes": tr, **({"prob": math.exp(lp)} if post else {"logprob": lp})})
        if post:
            entry["prob"] = math.exp(tp.logprob)
            entry["top_probs"] = tops
        else:
            entry["logprob"] = tp.logprob
            entry["top_logprobs"] = tops
        out.append(entry)
    return out


def oai_logprobs(probs: Sequence[Any], detok) -> dict:  # type: ignore[no-untyped-def]
    """OpenAI chat ``logprobs``: {"content": [{token, logprob, bytes, top_logprobs: [...]}]}."""
    content = []
    for tp in probs:
        text, raw = _piece(detok, tp.token)
        tops = []
        for t, lp in tp.top:
            tt, tr = _piece(detok, t)
            tops.append({"id": t, "token": tt, "bytes": tr, "logprob": lp})
        content.append({"id": tp.token, "token": text, "bytes": raw, "logprob": tp.logprob, "top_logprobs": tops})
    return {"content": content}


# -- /infill --------------------------------------------------------------------------------------

@client_input
def check_infill(body: dict, info) -> None:  # type: ignore[no-untyped-def]
    """llama-server's checks: the model's FIM tokens, and the request's fields."""
    missing = [name for name, tok in (("prefix", info.token_fim_pre), ("suffix", info.token_fim_suf),
                                      ("middle", info.token_fim_mid)) if tok < 0]
    if missing:
        raise APIError(501, "Infill is not supported by this model: "
                       + " ".join(f"{m} token is missing." for m in missing), "not_supported_error")
    if "prompt" in body and not isinstance(body["prompt"], str):
        raise APIError(400, '"prompt" must be a string')
    if "input_prefix" not in body:
        raise APIError(400, '"input_prefix" is required')
    if "input_suffix" not in body:
        raise APIError(400, '"input_suffix" is required')
    for name in ("input_prefix", "input_suffix"):
        value = body[name]
        if not (isinstance(value, str) or isinstance(value, list) and all(
                isinstance(v, str) or _is_int(v) for v in value)):
            raise APIError(400, f'"{name}" must be a string or a list of strings and token ids')
    extra = body.get("input_extra", [])
    if not isinstance(extra, list):
        raise APIError(400, '"input_extra" must be an array of {"filename": string, "text": string}')
    for chunk in extra:
        if not isinstance(chunk, dict) or not isinstance(chunk.get("text"), str):
            raise APIError(400, 'extra_context chunk must contain a "text" field with a string value')
        if "filename" in chunk and not isinstance(chunk["filename"], str):
            raise APIError(400, 'extra_context chunk\'s "filename" field must be a string')


def _mixed(value: Any, tokenize) -> list[int]:  # type: ignore[no-untyped-def]
    if isinstance(value, str):
        return tokenize(value)
    if isinstance(value, list):
        out: list[int] = []
        for v in value:
            out.extend(tokenize(v) if isinstance(v, str) else [int(v)])
        return out
    raise APIError(400, "'input_prefix' / 'input_suffix' must be a string or a list of strings and token ids")


def infill_tokens(body: dict, info, tokenize, n_batch: int, n_predict: int, n_ctx: int,  # type: ignore[no-untyped-def]
                  spm: bool = False) -> list[int]:
    """The repo-level FIM prompt llama-server builds (arXiv 2409.12186): extra chunks as files
    after [FIM_REP]myproject, then [FIM_PRE]prefix prompt [FIM_SUF]suffix [FIM_MID], the prefix
    and suffix cut to fit one batch (3:1), the chunks to what the context leaves."""
    prefix = _mixed(body["input_prefix"], tokenize)
    suffix = _mixed(body["input_suffix"], tokenize)
    prompt = tokenize(body.get("prompt") or "")
    extra: list[int] = []
    if info.token_fim_rep >= 0:
        extra += [info.token_fim_rep] + tokenize("myproject\n")
    for chunk in body.get("input_extra", []):
        if info.token_fim_sep >= 0:
            extra += [info.token_fim_sep] + tokenize(chunk.get("filename", "tmp") + "\n")
        else:
            extra += tokenize("\n\n--- snippet ---\n\n")
        extra += tokenize(chunk["text"])
    if info.token_fim_sep >= 0:
        extra += [info.token_fim_sep] + tokenize("filename\n")
    n_prefix = min(len(prefix), 3 * (n_batch // 4))
    n_suffix = min(len(suffix), max(0, n_batch // 4 - (2 + len(prompt))))
    n_extra = min(max(0, n_ctx - n_batch - 2 * n_predict), len(extra))
    prefix = [info.token_fim_pre] + prefix[len(prefix) - n_prefix:] + prompt
    suffix = [info.token_fim_suf] + suffix[:n_suffix]
    first, second = (suffix, prefix) if spm else (prefix, suffix)
    head = [info.token_bos] if info.add_bos and info.token_bos >= 0 else []
    return (extra[len(extra) - n_extra:] if n_extra else []) + head + first + second + [info.token_fim_mid]


# -- embeddings -----------------------------------------------------------------------------------

def normalize(rows: np.ndarray, mode: int) -> np.ndarray:
    """llama.cpp's embd_normalize: -1 none, 0 max-abs (int16 range), 1 taxicab, 2 euclidean, >2 p-norm."""
    rows = rows.astype(np.float64)
    if mode < 0:
        return rows
    if mode == 0:
        norm = np.abs(rows).max(axis=1, keepdims=True) / 32760.0
    elif mode == 1:
        norm = np.abs(rows).sum(axis=1, keepdims=True)
    elif mode == 2:
        norm = np.sqrt((rows * rows).sum(axis=1, keepdims=True))
    else:
        norm = (np.abs(rows) ** mode).sum(axis=1, keepdims=True) ** (1.0 / mode)
    norm[norm == 0] = 1.0
    return rows / norm


def embedding_rows(rows: np.ndarray, mode: int) -> list[list[float]]:
    return [[float(x) for x in r] for r in normalize(rows, mode)]


def base64_floats(row: Sequence[float]) -> str:
    return base64.b64encode(struct.pack(f"<{len(row)}f", *row)).decode("ascii")
