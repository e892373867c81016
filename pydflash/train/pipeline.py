"""``pydflash train``: capture -> train -> export, resumable at every stage.

    pydflash train --target smollm2-135m --prompts humaneval,stdlib --out runs/smollm2 \\
        --layers 1 --block-size 8 --steps 3000 --threads 1

``--out`` holds everything: ``cache/`` (captured features), ``checkpoint.pt`` (resumed
automatically), ``train-log.jsonl``, ``hf/`` (the HF checkpoint the converter reads) and the
GGUF files (F16 + the ``--quant`` types). Running the same command again continues where it
stopped; ``--export-only`` re-exports the last checkpoint.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Iterable, Sequence

__all__ = ["build_config", "capture", "export", "main", "default_taps"]


def default_taps(n_layers: int, count: int = 4) -> list[int]:
    """``count`` HF layer ids spread from layer 1 to layer n-2 (the last layer's output is
    post-norm in HF and special in llama.cpp, so it is not tapped)."""
    if n_layers < 4:
        return list(range(max(1, n_layers - 1)))
    return sorted({round(1 + i * (n_layers - 3) / (count - 1)) for i in range(count)})


def build_config(facts: dict, *, layers: int = 1, taps: Sequence[int] | None = None, block_size: int = 8,
                 selector_rank: int = 32, selector_top_k: int = 8, mask_token_id: int = 0,
                 conv_group_size: int = 16, ffn: int | None = None):  # type: ignore[no-untyped-def]
    """A DFlash2 config shaped like the target's layers (so they can seed the drafter).

    ``ffn`` narrows the drafter's SwiGLU below the target's width (a smaller shipped file; the
    layer then starts from the target's most important FFN neurons, ``init_from_target``).
    """
    from ..reference.config import DFlashConfig

    taps = list(taps) if taps else default_taps(facts["num_layers"])
    if ffn is not None and not 0 < ffn <= facts["intermediate_size"]:
        raise ValueError(f"--ffn {ffn} outside 1..{facts['intermediate_size']} (the target's FFN width)")
    bad = [t for t in taps if not 0 <= t < facts["num_layers"] - 1]
    if bad:
        raise ValueError(f"tap layers {bad} outside 0..{facts['num_layers'] - 2} for this target")
    return DFlashConfig(
        hidden_size=facts["hidden_size"], num_hidden_layers=layers, num_attention_heads=facts["num_heads"],
        num_key_value_heads=facts["num_kv_heads"], head_dim=facts["head_dim"],
        intermediate_size=ffn or facts["intermediate_size"], vocab_size=facts["vocab_size"], target_layer_ids=tuple(taps),
        rms_norm_eps=facts["rms_norm_eps"], rope_theta=facts["rope_theta"], max_position_embeddings=32768,
        block_size=block_size, mask_token_id=mask_token_id, is_causal=False, conv_kernel_size=2,
        conv_group_size=conv_group_size, selector_rank=selector_rank, selector_top_k=selector_top_k,
        num_target_layers=facts["num_layers"],
    )


def _progress(label: str, total: int):  # type: ignore[no-untyped-def]
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=label, leave=True)


def capture(target_path: str, prompts, cache_dir: str | os.PathLike, taps: Sequence[int], *,  # type: ignore[no-untyped-def]
            max_prompt: int = 384, max_new: int = 192, threads: int | None = None, batch: int = 4,
            samples: int = 0, temperature: float = 0.8, shard_size: int = 64, max_minutes: float | None = None,
            step_rows: int = 64, exclude: Iterable[str] = (), log=print) -> "object":
    """Generate and capture every prompt not yet in the cache; returns the FeatureCache.

    Each prompt gets its greedy continuation (id = the prompt's id) and ``samples`` sampled ones at
    ``temperature`` (ids ``<id>#s<k>``), ``batch`` sequences decoding together. Finished sequences
    are written in shards of ``shard_size``, so an interrupted capture resumes where it stopped.
    Prompts are taken in a fixed pseudo-random order (by id), so any prefix of the capture mixes
    every source; past ``max_minutes`` no new sequence starts (the running ones finish).
    Sequence ids in ``exclude`` are skipped as if cached: what another cache already holds (a fresh
    machine continuing a drafter that was trained on it) is not captured again.
    """
    from ..runtime.target import Target
    from .features import Continuation, FeatureCache, capture_continuations

    cache = FeatureCache(cache_dir, tap_layers=taps, target_name=Path(target_path).name)
    done = set(cache.ids) | set(exclude)
    todo = []
    for p in prompts:
        for k in range(samples + 1):
            sid = p.id if k == 0 else f"{p.id}#s{k}"
            if sid not in done:
                todo.append((p, sid, 0.0 if k == 0 else temperature, k))
    if not todo:
        return cache
    # salted: the validation split (_split) hashes the bare id, and a capture in that order would
    # fill validation first
    todo.sort(key=lambda job: hashlib.sha256(b"capture-order:" + job[1].encode()).digest())
    log(f"capture: {len(todo)} sequences ({len(done)} cached), taps {list(taps)}, {batch} in parallel")
    n_ctx = max_prompt + max_new + 8
    with Target(target_path, n_ctx=n_ctx, n_threads=threads, n_seq_max=batch,  # n_ctx: per sequence
                n_batch=max(512, batch)) as target:
        jobs = []
        for p, sid, temp, k in todo:
            toks = target.tokenize(p.render(target), parse_special=bool(p.messages))
            if 2 <= len(toks) <= max_prompt:
                seed = int(hashlib.sha256(sid.encode()).hexdigest()[:8], 16)
                jobs.append(Continuation(sid, toks, temp, seed))
        bar = _progress("capture", len(jobs))
        t0, n_tok, shard = time.monotonic(), 0, []

        def until_deadline():  # type: ignore[no-untyped-def]
            for job in jobs:
                if max_minutes is not None and time.monotonic() - t0 > 60 * max_minutes:
                    log(f"capture: time budget of {max_minutes} min reached")
                    return
                yield job

        for seq in capture_continuations(target, until_deadline(), taps, max_tokens=max_new, n_parallel=batch,
                                           step_rows=step_rows):
            shard.append(seq)
            n_tok += len(seq.tokens)
            bar.update(1)
            if len(shard) >= shard_size:
                cache.append(shard)
                shard = []
        cache.append(shard)
        bar.close()
        dt = time.monotonic() - t0
        log(f"capture: {n_tok} tokens in {dt:.0f} s ({n_tok / max(dt, 1e-9):.0f} tokens/s); "
            f"cache holds {cache.n_tokens} tokens")
    return cache


def read_ids(path: str | os.PathLike) -> set[str]:
    """Sequence ids, one per line, from a text file or its gzip (``trained-ids.txt.gz``)."""
    import gzip

    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        return {line.strip() for line in f if line.strip()}


def export(model, out_dir: str | os.PathLike, target_gguf: str, *, name: str,  # type: ignore[no-untyped-def]
           quant: Sequence[str] = ("Q8_0",), threads: int | None = None, outtype: str = "bf16",
           tokenizer: bool = True) -> list[Path]:
    """HF checkpoint (``out_dir/hf/<name>``) -> ``<name>-BF16.gguf`` (``outtype``) -> quantized variants
    (``tokenizer=False``: without the target's tokenizer, ``convert``)."""
    import torch
    from safetensors.torch import save_file

    from ..formats.convert import convert
    from ..formats.quantize import quantize

    out_dir = Path(out_dir)
    hf = out_dir / "hf" / name
    hf.mkdir(parents=True, exist_ok=True)
    (hf / "config.json").write_text(json.dumps(model.config.to_hf(), indent=2))
    tensors = {k: v.detach().to(torch.float32).contiguous() for k, v in model.state_dict().items()}
    save_file(tensors, str(hf / "model.safetensors"), metadata={"format": "pt"})
    f16 = convert(hf, out_dir / f"{name}-{outtype.upper()}.gguf", target_gguf=target_gguf, outtype=outtype,
                  progress=False, tokenizer=tokenizer)
    files = [f16]
    for q in quant:
        files.append(quantize(f16, out_dir / f"{name}-{q.upper()}.gguf", q, n_threads=threads, progress=False))
    return files


def _split(sequences, val_fraction: float):  # type: ignore[no-untyped-def]
    """Deterministic train/validation split by sequence id (a sampled continuation goes with its
    prompt's greedy one, so validation never sees a prompt that training saw)."""
    def is_val(sid: str) -> bool:
        key = b"validation:" + sid.split("#", 1)[0].encode()
        return int(hashlib.sha256(key).hexdigest()[:8], 16) / 0xFFFFFFFF < val_fraction

    return [s for s in sequences if not is_val(s.id)], [s for s in sequences if is_val(s.id)]


def save_portable(trainer, path: str | os.PathLike) -> Path:  # type: ignore[no-untyped-def]
    """What the next training run needs to continue, small enough to commit: the weights in bf16,
    the draft vocabulary, the step, the settings and the log (no optimizer state: a run resumed
    from it starts Adam's moments afresh)."""
    import torch

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    state = {"format": "pydflash-train-portable-1", "step": trainer.step, "config": trainer.model.config.to_hf(),
             "model": {k: v.detach().to(torch.bfloat16) for k, v in trainer.model.state_dict().items()},
             "draft_vocab": None if trainer.draft_vocab is None else trainer.draft_vocab.clone(),
             "draft_vocab_report": trainer.draft_vocab_report, "history": trainer.history}
    tmp = path.with_suffix(".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)
    return path


def load_portable(trainer, path: str | os.PathLike, *, grow: bool = False) -> int:  # type: ignore[no-untyped-def]
    """Start ``trainer`` from a ``save_portable`` file (same drafter config); returns its step.

    ``grow``: the file may hold a drafter with fewer layers (otherwise the same config); the new
    layers go on top as the identity (``init.grow_layers``) and the learning-rate schedule starts
    afresh at the file's step (warm-up, then cosine to ``settings.steps``), since the new layers
    start untrained."""
    import torch

    from .init import grow_layers

    state = torch.load(path, weights_only=False)
    if state.get("format") != "pydflash-train-portable-1":
        raise ValueError(f"{path} is not a portable training checkpoint (pydflash train --save-portable)")
    mine = trainer.model.config.to_hf()
    weights = {k: v.to(torch.float32) for k, v in state["model"].items()}
    deeper = state["config"] != mine
    if not deeper:
        trainer.model.load_state_dict(weights)
    else:
        layer_keys = ("num_hidden_layers", "layer_types")
        other = {k: v for k, v in state["config"].items() if k not in layer_keys}
        if not grow or other != {k: v for k, v in mine.items() if k not in layer_keys}:
            raise ValueError(f"{path} was trained with another drafter config"
                             + ("" if grow else " (--grow-from adds layers to a shallower one)"))
        grow_layers(trainer.model, weights, int(state["config"]["num_hidden_layers"]))
    if state.get("draft_vocab") is not None and len(state["draft_vocab"]) == trainer.settings.draft_vocab:
        trainer._set_draft_vocab(state["draft_vocab"])
        trainer.draft_vocab_report = dict(state.get("draft_vocab_report") or {})
    trainer.step = int(state["step"])
    trainer.history = list(state.get("history") or [])
    if deeper:
        trainer.schedule_start = trainer.step
    return trainer.step


def _eog_ids(target_path: str) -> list[int]:
    """The target's end-of-generation token ids (always in the draft vocabulary)."""
    from ..runtime.target import Target

    with Target(target_path, n_ctx=64, n_threads=1) as target:
        return [t for t in range(target.info.n_vocab) if target.is_eog(t)]


def build_parser(prog: str = "pydflash train") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description="train a DFlash2 drafter from a GGUF target (torch extra)")
    p.add_argument("--target", required=True, help="target GGUF path or a `pydflash models` name")
    p.add_argument("--prompts", default="humaneval,stdlib",
                   help="prompt sources: humaneval, gsm_symbolic, stdlib, pysrc:PKG, chat:SOURCE, *.jsonl (comma-separated; "
                        "held-out HumanEval/132..163 are always excluded)")
    p.add_argument("--limit", type=int, default=None, help="prompts per source")
    p.add_argument("--out", required=True, help="run directory (cache, checkpoint, logs, exports)")
    p.add_argument("--name", default=None, help="drafter name (default: <target>-dflash2)")
    p.add_argument("--layers", type=int, default=1, help="drafter layers (default 1)")
    p.add_argument("--taps", default=None, help="tapped target layers, HF ids (default: 4 spread layers)")
    p.add_argument("--block-size", type=int, default=8)
    p.add_argument("--ffn", type=int, default=None,
                   help="drafter FFN width (default: the target's); narrower layers start from the target's most "
                        "important FFN neurons, for a smaller shipped file")
    p.add_argument("--selector-rank", type=int, default=32)
    p.add_argument("--selector-top-k", type=int, default=8)
    p.add_argument("--mask-token-id", type=int, default=0)
    p.add_argument("--max-prompt", type=int, default=384, help="longer prompts are skipped")
    p.add_argument("--max-new", type=int, default=192, help="continuation tokens per prompt")
    p.add_argument("--samples", type=int, default=0,
                   help="sampled continuations per prompt, next to the greedy one (default 0)")
    p.add_argument("--sample-temp", type=float, default=0.8, help="temperature of the sampled continuations")
    p.add_argument("--parallel", type=int, default=16,
                   help="sequences the target decodes together while capturing (8-16 measured fastest on 2 "
                        "cores with SmolLM2, benchmarks/results/capture-throughput)")
    p.add_argument("--step-rows", type=int, default=64,
                   help="most target rows per capture step: prompts are prefilled in slices of this size so "
                        "they stay on the multi-row kernels (0 = one ubatch per prompt)")
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--seqs-per-step", type=int, default=4)
    p.add_argument("--anchors-per-seq", type=int, default=16)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--gamma", type=float, default=4.0, help="slot weight decay exp(-(j-1)/gamma)")
    p.add_argument("--draft-vocab", type=int, default=8192,
                   help="draft vocabulary: the loss's softmax and the exported drafter (d2t) keep this many head "
                        "rows, the training labels' most frequent (0 = the full head)")
    p.add_argument("--autocast", choices=("auto", "bf16", "fp32"), default="auto",
                   help="bf16 autocast: auto = only on CPUs with native bf16 (AVX512-BF16 / AMX)")
    p.add_argument("--soft-weight", type=float, default=0.0,
                   help="weight of distillation to the target's own next-token distribution (its last layer run "
                        "on the cached taps; 0 = hard greedy labels only)")
    p.add_argument("--copy-weight", type=float, default=0.0,
                   help="weight of the copy-head loss: attention heads of the last layer are taught to look at "
                        "the earlier rows that end a match of the anchor's last tokens (where the target's "
                        "continuation repeats itself); 0 = off")
    p.add_argument("--copy-head", default="1",
                   help="the query head(s) the copy-head loss trains, comma-separated (heads of different KV groups "
                        "read different values)")
    p.add_argument("--copy-match", type=int, default=1,
                   help="the copy head looks at the rows ending the longest earlier match of the anchor's last "
                        "tokens, up to this many (1 = the anchor's token; 2 needs a drafter of 2+ layers to see "
                        "the token before the anchor)")
    p.add_argument("--copy-successor", action="store_true",
                   help="the copy head looks at the row after each match (it holds the token that followed) instead "
                        "of the match's own row (its prediction of that token)")
    p.add_argument("--repeat-keep", type=float, default=1.0,
                   help="sampling weight (0..1, against 1) of anchors whose last --repeat-ngram tokens already "
                        "occurred earlier in the sequence: a small target's greedy captures loop far more than "
                        "its answers to real prompts, and the history lookup drafts loops anyway (1 = uniform)")
    p.add_argument("--repeat-ngram", type=int, default=16, help="tokens that make an anchor a repeat (default 16)")
    p.add_argument("--max-minutes", type=float, default=None, help="stop training after this long (resumable)")
    p.add_argument("--checkpoint-every", type=int, default=100)
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--quant", default="Q8_0,Q4_K_M", help="quantized exports (comma-separated; '' = none)")
    p.add_argument("--no-tokenizer", action="store_true",
                   help="exports without the target's tokenizer (pydflash pairs drafter and target on tensor shapes; "
                        "6 MB less for a 151,936-token vocabulary)")
    p.add_argument("--head-from-target", action="store_true",
                   help="exports store the draft vocabulary's ids (d2t) but not its head rows, which the engine "
                        "takes from the target at load time (7.8 MB less for Qwen2.5's head at --draft-vocab 8192)")
    p.add_argument("--threads", type=int, default=None, help="CPU threads for torch and the target")
    p.add_argument("--capture-only", action="store_true")
    p.add_argument("--no-capture", action="store_true", help="train on what the cache holds (skip new prompts)")
    p.add_argument("--exclude-ids", default=None, metavar="FILE",
                   help="sequence ids (one per line, .gz read as gzip) the capture skips as if cached: the ids "
                        "a drafter was already trained on, when its cache is not on this machine")
    p.add_argument("--export-only", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--curve", default=None,
                   help="after exporting, measure held-out tau (HumanEval/132..163, greedy, native engine) and "
                        "append the point to this JSONL file; learning-curve.md/.png are rendered beside it")
    p.add_argument("--curve-n-max", type=int, default=7, help="n_max of the --curve measurement")
    p.add_argument("--resume-from", default=None,
                   help="a portable checkpoint (--save-portable) to start from when --out holds no checkpoint yet")
    p.add_argument("--grow-from", default=None,
                   help="like --resume-from, from a drafter with fewer --layers: the new layers go on top as the "
                        "identity and the learning-rate schedule restarts (warm-up, cosine to --steps)")
    p.add_argument("--new-schedule", action="store_true",
                   help="with --resume-from: restart the learning-rate schedule at the resumed step (warm-up, "
                        "cosine to --steps), e.g. for a chunk on newly captured data")
    p.add_argument("--save-portable", default=None,
                   help="after training, write the weights (bf16), draft vocabulary, step and log here: what the "
                        "next run needs to continue, small enough to commit")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not 0.0 <= args.soft_weight <= 1.0:
        parser.error(f"--soft-weight must be within [0, 1], got {args.soft_weight}")
    if args.copy_weight < 0:
        parser.error(f"--copy-weight must be >= 0, got {args.copy_weight}")
    if not 0.0 <= args.repeat_keep <= 1.0:
        parser.error(f"--repeat-keep must be within [0, 1], got {args.repeat_keep}")
    if args.repeat_ngram < 1:
        parser.error(f"--repeat-ngram must be >= 1, got {args.repeat_ngram}")
    if args.copy_match < 1:
        parser.error(f"--copy-match must be >= 1, got {args.copy_match}")
    if args.resume_from and args.grow_from:
        parser.error("give --resume-from or --grow-from, not both")
    if args.new_schedule and not args.resume_from:
        parser.error("--new-schedule restarts the schedule of a --resume-from run (--grow-from always does)")
    try:
        import torch
    except ImportError:
        print("pydflash train needs torch: pip install 'pydflash[train]'", file=sys.stderr)
        return 1
    from ..fetch import registry as models
    from ..reference.model import DFlashDrafter, TargetWeights
    from . import prompts as train_prompts
    from .features import FeatureCache
    from .init import init_from_target, target_facts
    from .trainer import Trainer, TrainSettings, export_draft_vocab
    from .teacher import LastLayerTeacher

    if args.threads:
        torch.set_num_threads(args.threads)
    target_path = str(models.resolve(args.target))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log_file = open(out / "train-log.jsonl", "a", encoding="utf-8")

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)
        log_file.write(msg + "\n")
        log_file.flush()

    facts = target_facts(target_path)
    taps = [int(x) for x in args.taps.split(",")] if args.taps else None
    try:
        config = build_config(facts, layers=args.layers, taps=taps, block_size=args.block_size,
                              selector_rank=args.selector_rank, selector_top_k=args.selector_top_k,
                              mask_token_id=args.mask_token_id, ffn=args.ffn)
    except ValueError as e:  # taps or --ffn outside the target's shape
        parser.error(str(e))
    try:
        copy_heads = tuple(int(h) for h in args.copy_head.split(","))
    except ValueError:
        parser.error(f"--copy-head takes comma-separated head numbers, got {args.copy_head!r}")
    if not all(0 <= h < config.num_attention_heads for h in copy_heads) or len(set(copy_heads)) != len(copy_heads):
        parser.error(f"--copy-head must name distinct heads within [0, {config.num_attention_heads}), got {args.copy_head}")
    name = args.name or f"{Path(target_path).stem.split('-Q')[0]}-DFlash2"
    cache_dir = out / "cache"
    if not (args.export_only or args.no_capture):
        prompts = train_prompts.load(args.prompts, limit=args.limit)
        try:
            exclude = read_ids(args.exclude_ids) if args.exclude_ids else set()
        except (OSError, EOFError, UnicodeDecodeError) as e:
            parser.error(f"--exclude-ids: {e}")
        capture(target_path, prompts, cache_dir, config.target_layer_ids, max_prompt=args.max_prompt,
                max_new=args.max_new, threads=args.threads, batch=args.parallel, samples=args.samples,
                temperature=args.sample_temp, step_rows=args.step_rows, max_minutes=args.max_minutes if args.capture_only else None,
                exclude=exclude, log=log)
    if args.capture_only:
        return 0
    model = DFlashDrafter(config)
    init_notes = init_from_target(model, target_path, seed=args.seed)
    weights = TargetWeights.from_gguf(target_path)
    settings = TrainSettings(steps=args.steps, seqs_per_step=args.seqs_per_step, anchors_per_seq=args.anchors_per_seq,
                             lr=args.lr, gamma=args.gamma, seed=args.seed, checkpoint_every=args.checkpoint_every,
                             eval_every=args.eval_every, max_minutes=args.max_minutes,
                             max_len=args.max_prompt + args.max_new, draft_vocab=args.draft_vocab,
                             autocast=args.autocast, soft_weight=args.soft_weight,
                             copy_weight=args.copy_weight, copy_heads=copy_heads, copy_match=args.copy_match,
                             copy_successor=args.copy_successor, repeat_keep=args.repeat_keep,
                             repeat_ngram=args.repeat_ngram)
    cache = FeatureCache(cache_dir)
    train_seqs, val_seqs = _split(cache.sequences(decode=False), 0.05)
    teacher = LastLayerTeacher(target_path, weights.lm_head) if args.soft_weight > 0 else None
    trainer = Trainer(model, weights, train_seqs, val_seqs, settings, out, log=log, eog_ids=_eog_ids(target_path),
                      teacher=teacher)
    if trainer.load_checkpoint():
        log(f"resumed from {trainer.checkpoint_path} at step {trainer.step}")
    elif args.resume_from or args.grow_from:
        src = args.grow_from or args.resume_from
        try:
            step = load_portable(trainer, src, grow=bool(args.grow_from))
        except (OSError, ValueError) as e:
            parser.error(str(e))
        if args.new_schedule:
            trainer.schedule_start = step
        log(f"started from the portable checkpoint {src} at step {step}"
            + (f" ({config.num_hidden_layers} layers)" if args.grow_from else "")
            + (f", learning-rate schedule from step {trainer.schedule_start}" if trainer.schedule_start else ""))
    else:
        log(json.dumps({"init": init_notes, "config": config.to_hf(), "train_sequences": len(train_seqs),
                        "val_sequences": len(val_seqs), "train_tokens": sum(len(s.tokens) for s in train_seqs),
                        "soft_weight": args.soft_weight,
                        "draft_vocab": trainer.draft_vocab_report, "bf16_autocast": trainer.bf16}))
    if not args.export_only:
        bar = _progress("train", settings.steps)
        bar.update(trainer.step)

        def on_step(rec: dict) -> None:
            bar.set_description_str(f"train loss {rec['loss']:.3f} ({rec['s_per_step']:.2f} s/step)", refresh=False)
            bar.update(rec["step"] - bar.n)

        trainer.fit(on_step)
        bar.close()
    if args.save_portable:
        log(f"portable checkpoint: {save_portable(trainer, args.save_portable)}")
    quant = [q for q in args.quant.split(",") if q]
    files = export(model, out, target_path, name=name, quant=quant, threads=args.threads,
                   tokenizer=not args.no_tokenizer)
    if trainer.draft_vocab is not None:  # the exported drafters draft over the vocabulary they were trained on
        export_draft_vocab(files, target_path, trainer.draft_vocab.numpy(), trainer.draft_vocab_report,
                           store_head=not args.head_from_target)
    log(json.dumps({"exported": [str(f) for f in files], "step": trainer.step}))
    if args.curve:
        from . import curve

        point = curve.heldout_tau(target_path, str(files[-1]), n_max=args.curve_n_max, threads=args.threads)
        val = [h["val_tau"] for h in trainer.history if "val_tau" in h]
        point.update(run=out.name, step=trainer.step, drafter=files[-1].name,
                     blocks_trained=trainer.step * settings.seqs_per_step * settings.anchors_per_seq,
                     train_tokens=sum(len(s.tokens) for s in train_seqs), val_tau=val[-1] if val else float("nan"),
                     time=time.strftime("%Y-%m-%d %H:%M"))
        curve.append_point(args.curve, point)
        curve.render(args.curve, Path(args.curve).parent, title=f"{Path(target_path).stem} drafter")
        log(json.dumps({"curve": point}))
    return 0
