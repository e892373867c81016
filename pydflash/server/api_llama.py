"""llama.cpp's native API (llama-server's own routes): ``/completion`` (``/completions``),
``/infill``, ``/tokenize``, ``/detokenize``, ``/apply-template``, ``/embedding`` (``/embeddings``),
``/slots`` (and slot files: ``POST /slots/{id}?action=save|restore|erase``), ``/props`` and, with
``--metrics``, Prometheus ``/metrics``: routes, request parsing and answers.

``native_answer`` is llama.cpp's final ``/completion`` object, also the ``__verbose`` of the OpenAI
answers; the embedding helpers serve ``/v1/embeddings`` too.
"""

from __future__ import annotations

import asyncio
import math
import os
import time
from typing import Any, Sequence

import numpy as np

from .. import errors
from .answers import STOP_TYPES, SYSTEM_FINGERPRINT, nested_fields, timed
from .jobs import (INT32_MAX, APIError, Job, client_input, field_value, from_engine_error, is_bool,
                   is_int, parse_prompts)
from .loop import SlotView
from .text import detokenize, piece_json, tokenize_mixed

__all__ = ["check_embeddings", "embed", "embedding_inputs", "embedding_rows", "native_answer", "probs_json",
           "register"]


def register(http, router) -> None:  # type: ignore[no-untyped-def]
    routes = _Llama(http)
    router.add_post("/completions", routes.completion)  # llama-server: the native endpoint, not OpenAI's
    router.add_post("/completion", routes.completion)
    router.add_post("/tokenize", routes.tokenize)
    router.add_post("/detokenize", routes.detokenize)
    router.add_post("/infill", routes.infill)
    router.add_post("/apply-template", routes.apply_template)
    router.add_post("/embedding", routes.embedding)
    router.add_post("/embeddings", routes.embedding)
    router.add_post("/slots/{id}", routes.slot_action)
    router.add_get("/slots", routes.slots)
    router.add_get("/props", routes.props)
    router.add_get("/metrics", routes.prometheus)


# -- answers --------------------------------------------------------------------------------------

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


def native_answer(http, job: Job, res, content: str, tokens: list[int],  # type: ignore[no-untyped-def]
                  stops: tuple) -> dict:
    """llama.cpp's final /completion object (also the ``__verbose`` of the OpenAI answers)."""
    st = res.stats
    extra = {}
    if res.probs is not None and content:
        extra["completion_probabilities"] = probs_json(res.probs, http.piece_bytes,
                                                       bool(job.constraints.post_sampling_probs))
    return {**extra,
        "index": job.index, "content": content, "tokens": tokens, "id_slot": job.slot,
        "stop": True, "model": http.model_id, "tokens_predicted": st.n_generated,
        "tokens_evaluated": st.n_prompt, "generation_settings": http.settings(job),
        "prompt": job.prompt_text, "has_new_line": "\n" in res.text,
        "truncated": st.stop_reason == "context", "stop_type": STOP_TYPES[st.stop_reason],
        "stopping_word": stops[0] if st.stop_reason == "stop" and len(stops) == 1 else "",
        # what the slot's KV holds now: the prompt and every generated token but the last
        "tokens_cached": st.n_prompt + max(st.n_generated - 1, 0), "timings": http.timings(res),
    }


def returned_tokens(res) -> list[int]:  # type: ignore[no-untyped-def]
    tokens = list(res.tokens)
    if res.stats.stop_reason == "eos" and tokens:
        tokens = tokens[:-1]  # as llama-server: the end-of-generation token is not returned
    return tokens


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
                isinstance(v, str) or is_int(v) for v in value)):
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


def check_embeddings(config) -> None:  # type: ignore[no-untyped-def]
    if not config.embeddings:
        raise APIError(501, "This server does not support embeddings. Start it with `--embeddings`",
                       "not_supported_error")


@client_input
def embedding_inputs(http, value: Any, name: str) -> list[list[int]]:  # type: ignore[no-untyped-def]
    """A request's embedding inputs as token lists (llama-server's forms), checked."""
    target = http.engine.target
    def one(v: Any) -> list[int]:
        if isinstance(v, dict):  # {"prompt_string": ...} or {"content": [text parts]}
            if "prompt_string" in v:
                return one(v["prompt_string"])
            parts = v.get("content")
            if not isinstance(parts, list) or not parts or not all(
                    isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                    for p in parts):
                raise APIError(400, f"'{name}' objects need 'prompt_string' or 'content' text parts "
                                    "(this server has no multimodal projector)")
            return one("".join(p["text"] for p in parts))
        if isinstance(v, str):
            return tokenize_mixed(target, [v], add_special=True, parse_special=True)
        if isinstance(v, list) and v and all(isinstance(t, (int, str)) and not isinstance(t, bool) for t in v):
            return tokenize_mixed(target, v, add_special=True, parse_special=True) if any(
                isinstance(t, str) for t in v) else list(v)
        raise APIError(400, f"'{name}' must be a string, a list of token ids, or a list of those")

    # a list is several prompts when it holds lists or objects, or only strings; a list with
    # token ids (and maybe strings) is one mixed prompt (llama-server's forms)
    many = isinstance(value, list) and bool(value) and (
        any(isinstance(v, (list, dict)) for v in value) or all(isinstance(v, str) for v in value))
    if many:
        inputs = [one(v) for v in value]
    else:
        inputs = [one(value)]
    for toks in inputs:
        if not toks:
            raise APIError(400, "Input content cannot be empty")
        bad = [t for t in toks if not 0 <= t < target.info.n_vocab]
        if bad:
            raise APIError(400, f"token id {bad[0]} is outside the vocabulary (0..{target.info.n_vocab - 1})")
        if len(toks) > http.steps.n_ctx_slot:
            raise APIError(400, f"input is too large to process ({len(toks)} tokens, the context is "
                                f"{http.steps.n_ctx_slot})", "exceed_context_size_error")
    return inputs


async def embed(http, inputs: list[list[int]], pooling: str):  # type: ignore[no-untyped-def]
    target = http.engine.target
    loop = asyncio.get_running_loop()
    out = []
    for toks in inputs:  # a second context of the same weights: generation keeps running
        t0 = time.monotonic()
        try:
            out.append(await loop.run_in_executor(None, lambda t=toks: target.embed(t, pooling=pooling)))
        except errors.InvalidArgumentError as exc:
            raise APIError(400, str(exc)) from None
        http.metrics.add_embedding(len(toks), time.monotonic() - t0)
    return out


class _Llama:
    def __init__(self, http) -> None:  # type: ignore[no-untyped-def]
        self.http = http

    # -- status -------------------------------------------------------------------------------------

    def slot_json(self, index: int, view: SlotView) -> dict:
        """One slot as llama-server's /slots shows it (idle slots: the first four fields only)."""
        info, job = view.info, view.job
        out: dict[str, Any] = {"id": index, "n_ctx": self.http.steps.n_ctx_slot,
                               "speculative": self.http.speculative, "is_processing": job is not None}
        if job is None:
            return out
        max_tokens = job.options["max_tokens"]
        out.update({
            "id_task": job.seq_id,
            "n_prompt_tokens": info.n_prompt,
            "n_prompt_tokens_processed": info.n_prefilled,
            "n_prompt_tokens_cache": info.n_prompt_cached,
            "params": self.http.settings(job),
            "next_token": [{"has_next_token": info.state != "idle", "has_new_line": job.has_new_line,
                            "n_remain": max_tokens - info.n_generated if max_tokens >= 0 else -1,
                            "n_decoded": info.n_generated}],
        })
        return out

    async def slots(self, request):  # type: ignore[no-untyped-def]
        if not self.http.config.slots:
            raise APIError(501, "This server does not support slots endpoint.")
        return self.http.json([self.slot_json(i, v) for i, v in enumerate(self.http.steps.slots)])

    async def props(self, request):  # type: ignore[no-untyped-def]
        return self.http.json({
            "default_generation_settings": {"n_ctx": self.http.steps.n_ctx_slot, "params": self.http.settings(None)},
            "total_slots": self.http.config.n_slots, "model_path": self.http.model_path,
            "model_alias": self.http.model_id, "build_info": f"pydflash {SYSTEM_FINGERPRINT}",
            "endpoint_slots": self.http.config.slots, "endpoint_props": True,
            "endpoint_metrics": self.http.config.metrics,
            "is_sleeping": self.http.steps.sleeping, "cors_proxy_enabled": self.http.config.ui_mcp_proxy,
        })

    async def prometheus(self, request):  # type: ignore[no-untyped-def]
        if not self.http.config.metrics:
            raise APIError(501, "This server does not support metrics endpoint. Start it with `--metrics`.")
        n_pos = max(self.http.engine.n_max, 1) if self.http.speculative else 1
        text = self.http.metrics.render(self.http.steps.n_processing, self.http.steps.n_deferred, n_pos)
        return self.http.web.Response(text=text, content_type="text/plain", charset="utf-8")

    # -- tokenizer, templates ---------------------------------------------------------------------

    async def tokenize(self, request):  # type: ignore[no-untyped-def]
        """llama-server's /tokenize: ``content`` (a string or a mixed list of strings and ids),
        ``add_special`` (default false), ``parse_special`` (default true), ``with_pieces``."""
        body = await self.http.read_body(request)
        content = body.get("content")
        add_special = field_value(body, ["add_special"], is_bool, "a boolean", False)
        parse_special = field_value(body, ["parse_special"], is_bool, "a boolean", True)
        with_pieces = field_value(body, ["with_pieces"], is_bool, "a boolean", False)
        if content is None:
            return self.http.json({"tokens": []})
        if isinstance(content, str):
            pieces: list = [content]
        elif isinstance(content, list) and all(isinstance(p, str) or is_int(p) for p in content):
            pieces = content
        else:
            raise APIError(400, "'content' must be a string or a list of strings and token ids")

        def run(target):  # type: ignore[no-untyped-def]
            tokens = tokenize_mixed(target, pieces, add_special=add_special, parse_special=parse_special)
            if not with_pieces:
                return tokens
            return [{"id": t, "piece": piece_json(target, t)} for t in tokens]

        return self.http.json({"tokens": await self.http.on_target(run)})

    async def detokenize(self, request):  # type: ignore[no-untyped-def]
        body = await self.http.read_body(request)
        tokens = body.get("tokens")
        if tokens is None:
            return self.http.json({"content": ""})
        if not isinstance(tokens, list) or not all(is_int(t) for t in tokens):
            raise APIError(400, "'tokens' must be a list of token ids")
        return self.http.json({"content": await self.http.on_target(lambda t: detokenize(t, tokens))})

    async def apply_template(self, request):  # type: ignore[no-untyped-def]
        body = await self.http.read_body(request)
        chat = self.http.steps.chat
        if chat is None:
            raise APIError(503, "Loading model")
        try:
            rendered = await asyncio.get_running_loop().run_in_executor(None, chat.render, body)
        except (errors.InvalidArgumentError, RecursionError) as exc:  # RecursionError: the body, serialised
            raise from_engine_error(exc) from None
        return self.http.json({"prompt": rendered["prompt"]})

    # -- generation ---------------------------------------------------------------------------------

    def probs(self, job: Job, probs) -> list:  # type: ignore[no-untyped-def]
        return probs_json(probs, self.http.piece_bytes, bool(job.constraints.post_sampling_probs))

    async def completion(self, request, body: dict | None = None):  # type: ignore[no-untyped-def]
        """llama.cpp's native /completion (and /completions): one object per prompt, a list when
        the request has several. ``body``: an already parsed one (/infill)."""
        body = await self.http.read_body(request) if body is None else body
        if "prompt" not in body:
            raise APIError(400, "'prompt' is required")
        prompts = parse_prompts(body["prompt"])
        common, jobs, out = self.http.jobs(body, prompts, ["n_predict", "max_tokens", "max_completion_tokens"],
                                           piece_tokens=True)
        return_tokens = field_value(body, ["return_tokens"], is_bool, "a boolean", False)
        fields = body.get("response_fields") or []
        if not isinstance(fields, list) or not all(isinstance(f, str) for f in fields):
            raise APIError(400, "'response_fields' must be a list of strings")
        stops = common.options["stop"]

        def final(job: Job, res, content: str, tokens: list[int]) -> dict:  # type: ignore[no-untyped-def]
            data = native_answer(self.http, job, res, content, tokens, stops)
            return nested_fields(fields, data) if fields else data

        if common.stream:
            counts = [0] * len(jobs)

            def emit(kind: str, i: int, payload) -> list:  # type: ignore[no-untyped-def]
                job = jobs[i]
                if kind == "done":
                    return [final(job, payload, "", [])]
                msg = {"index": i, "content": "", "tokens": [], "stop": False, "id_slot": job.slot,
                       "tokens_predicted": counts[i], "tokens_evaluated": job.n_prompt}
                timed(msg, payload.timings)
                if kind == "progress":
                    msg["prompt_progress"] = payload.report
                else:
                    counts[i] += max(len(payload.tokens), 1)
                    msg.update(content=payload.text, tokens=list(payload.tokens), tokens_predicted=counts[i])
                    if payload.probs:
                        msg["completion_probabilities"] = self.probs(job, payload.probs)
                return [msg]

            return await self.http.serve(jobs, lambda: self.http.stream(request, jobs, out, emit, None, False))

        async def run():  # type: ignore[no-untyped-def]
            results = await self.http.collect(jobs, out)
            items = [final(job, res, res.text, returned_tokens(res) if return_tokens else [])
                     for job, res in zip(jobs, results)]
            return self.http.json(items[0] if len(items) == 1 else items)

        return await self.http.serve(jobs, run)

    async def infill(self, request):  # type: ignore[no-untyped-def]
        """llama-server's /infill: a /completion whose prompt is the repo-level FIM prompt."""
        body = await self.http.read_body(request)
        if self.http.engine is None:
            raise APIError(503, "Loading model")
        info = self.http.engine.target.info
        check_infill(body, info)

        def build(target):  # type: ignore[no-untyped-def]
            def tok(text: str) -> list[int]:
                return target.tokenize(text, add_special=False, parse_special=False)

            n_predict = body.get("n_predict", self.http.config.n_predict)
            n_predict = n_predict if isinstance(n_predict, int) and n_predict > 0 else 0
            return infill_tokens(body, info, tok, self.http.config.n_batch_fim, n_predict, self.http.steps.n_ctx_slot,
                                 self.http.config.spm_infill)

        tokens = await self.http.on_target(build)
        return await self.completion(request, {**body, "prompt": tokens})

    # -- embeddings ---------------------------------------------------------------------------------

    async def embedding(self, request):  # type: ignore[no-untyped-def]
        """llama-server's native /embedding: [{index, embedding}], a list of per-token rows under
        --pooling none, otherwise [[...]] with one pooled row."""
        check_embeddings(self.http.config)
        body = await self.http.read_body(request)
        value = body.get("content", body.get("input"))
        if value is None:
            raise APIError(400, "\"input\" or \"content\" must be provided")
        inputs = embedding_inputs(self.http, value, "content")
        norm = body.get("embd_normalize", 2)
        if not isinstance(norm, int) or isinstance(norm, bool) or not -INT32_MAX - 1 <= norm <= INT32_MAX:
            raise APIError(400, "'embd_normalize' must be a 32-bit int")
        pooling = self.http.config.pooling
        rows = await embed(self.http, inputs, pooling)
        data = [{"index": i, "embedding": embedding_rows(r, norm if pooling != "none" else -1)}
                for i, r in enumerate(rows)]
        return self.http.json(data)

    # -- slot files ---------------------------------------------------------------------------------

    async def slot_action(self, request):  # type: ignore[no-untyped-def]
        action = request.query.get("action", "")
        try:
            slot = int(request.match_info["id"])
        except ValueError:
            raise APIError(400, "Invalid slot id") from None
        if action not in ("save", "restore", "erase"):
            raise APIError(400, "Invalid action")
        body = await self.http.read_body(request) if request.can_read_body else {}
        if action != "erase" and not self.http.config.slot_save_path:
            raise APIError(501, "This server does not support slots action. Start it with `--slot-save-path`",
                           "not_supported_error")
        path = None
        if action != "erase":
            filename = body.get("filename")
            if not isinstance(filename, str) or not _valid_filename(filename):
                raise APIError(400, "Invalid filename")
            path = os.path.join(self.http.config.slot_save_path, filename)
        t0 = time.monotonic()

        def run(engine):  # type: ignore[no-untyped-def]
            sched = engine.scheduler
            if not 0 <= slot < sched.n_slots:
                raise APIError(400, "Invalid slot id")
            if action == "save":
                return sched.slot_save(slot, path)
            if action == "restore":
                return sched.slot_restore(slot, path)
            return sched.slot_erase(slot), 0

        try:
            n_tokens, n_bytes = await self.http.on_loop(run)
        except errors.BusyError as exc:
            raise APIError(400, str(exc)) from None
        except errors.ModelNotFoundError as exc:
            raise APIError(400 if action == "restore" else 500, str(exc)) from None
        ms = (time.monotonic() - t0) * 1000.0
        if action == "save":
            out = {"id_slot": slot, "filename": body["filename"], "n_saved": n_tokens, "n_written": n_bytes,
                   "timings": {"save_ms": ms}}
        elif action == "restore":
            out = {"id_slot": slot, "filename": body["filename"], "n_restored": n_tokens, "n_read": n_bytes,
                   "timings": {"restore_ms": ms}}
        else:
            out = {"id_slot": slot, "n_erased": n_tokens}
        return self.http.json(out)


def _valid_filename(name: str) -> bool:
    """llama.cpp's fs_validate_filename in spirit: one plain path component."""
    if not name or len(name) > 255 or name in (".", "..") or name.startswith("."):
        return False
    return not any(c in name for c in '/\\:*?"<>|\0') and name == name.strip()
