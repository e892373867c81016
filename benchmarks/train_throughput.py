"""Training throughput: blocks per second / per CPU-hour, the old trainer vs the new, interleaved.

    pydflash train --target smollm2-135m --prompts stdlib --limit 40 --out /tmp/tt/run --capture-only \\
        --threads 2 --max-new 192
    python benchmarks/train_throughput.py --cache /tmp/tt/run/cache -m smollm2-135m --threads 2 \\
        --rounds 12 --out benchmarks/results/train-throughput

Modes (each its own Trainer on the same cached sequences, same drafter init, same seed):

* ``before``: the trainer of ``--before-rev`` (default c9f277d: full 49k-row head on every slot,
  anchors anywhere, context K/V repeated per block and query head), loaded from git.
* ``after``: this tree's defaults (draft vocabulary of ``--draft-vocab`` rows, head on counted
  slots only, anchors on continuations, batched context attention, float32 on CPUs without
  native bf16).
* ``after, full head``: this tree with ``draft_vocab=0`` (what the draft vocabulary buys).
* ``after, bf16``: this tree with bf16 autocast forced (``--bf16``; measures item 4).

``--coverage`` also measures the draft vocabulary's coverage at several N with the stdlib's own
Python source as a proxy for code continuations (vocabulary from ~1M tokens of half the files,
coverage of ~300k tokens of the other half): the basis for the default N.

Each round times one training step (batch sampling + forward + backward + optimizer) of every
mode in turn, after ``--warmup`` untimed steps each; the table gives medians over rounds.
Blocks = seqs_per_step x anchors_per_seq per step. A "CPU-hour" is one hour of ``--threads``
cores (so blocks/CPU-hour = blocks/s x 3600 / threads); process CPU seconds are reported too.
"""

from __future__ import annotations

import argparse
import importlib
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_flags() -> str:
    try:
        flags = set(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return platform.machine()
    return ",".join(f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in flags) or "none"


def load_old_trainer(rev: str):  # type: ignore[no-untyped-def]
    """The trainer package of ``rev`` (trainer, loss, forward) as module ``oldtrain``."""
    pkg = types.ModuleType("oldtrain")
    pkg.__path__ = []  # type: ignore[attr-defined]
    sys.modules["oldtrain"] = pkg
    tmp = Path(tempfile.mkdtemp(prefix="oldtrain-"))
    for name in ("loss", "forward", "trainer"):
        src = subprocess.run(["git", "-C", str(REPO), "show", f"{rev}:pydflash/train/{name}.py"], check=True,
                             capture_output=True, text=True).stdout
        src = (src.replace("from ..", "from pydflash.").replace("from .features", "from pydflash.train.features")
               .replace("from pydflash.draft_vocab", "from pydflash.formats.draft_vocab")
               .replace("from .forward", "from oldtrain.forward").replace("from .loss", "from oldtrain.loss"))
        path = tmp / f"{name}.py"
        path.write_text(src)
        spec = importlib.util.spec_from_file_location(f"oldtrain.{name}", path)
        mod = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
        sys.modules[f"oldtrain.{name}"] = mod
        spec.loader.exec_module(mod)  # type: ignore[union-attr]
    return sys.modules["oldtrain.trainer"]


def stdlib_coverage(target_path: str, sizes=(2048, 4096, 8192, 12288, 16384, 32768)) -> dict:  # type: ignore[no-untyped-def]
    """Held-out coverage of a vocabulary chosen on half the stdlib's files, measured on the rest."""
    import random
    import sysconfig

    import numpy as np

    from pydflash import Target
    from pydflash.formats.draft_vocab import TokenCounts, choose

    files = sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py"))
    files = [f for f in files if "test" not in f.parts and "site-packages" not in f.parts]
    random.Random(0).shuffle(files)
    with Target(target_path, n_ctx=64, n_threads=1) as t:
        n_vocab = t.info.n_vocab

        def count(group, cap):  # type: ignore[no-untyped-def]
            c = np.zeros(n_vocab, np.int64)
            for f in group:
                c += np.bincount(np.asarray(t.tokenize(f.read_text(errors="ignore")[:20000]), np.int64), minlength=n_vocab)
                if c.sum() > cap:
                    break
            return c

        calib, held = count(files[: len(files) // 2], 1_000_000), count(files[len(files) // 2:], 300_000)
        eog = [i for i in range(n_vocab) if t.is_eog(i)]
    counts = TokenCounts(output=calib, prompt=np.zeros(n_vocab, np.int64))
    cover = {str(n): round(float(held[choose(counts, n, always=eog)].sum() / held.sum()), 4) for n in sizes}
    return {"calibration_tokens": int(calib.sum()), "held_out_tokens": int(held.sum()), "held_out_coverage": cover}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cache", required=True, help="a `pydflash train` feature cache directory")
    ap.add_argument("-m", "--model", default="smollm2-135m")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--seqs-per-step", type=int, default=2)
    ap.add_argument("--anchors-per-seq", type=int, default=32)
    ap.add_argument("--draft-vocab", type=int, default=8192)
    ap.add_argument("--before-rev", default="c9f277d")
    ap.add_argument("--bf16", action="store_true", help="also time the new trainer with bf16 autocast forced")
    ap.add_argument("--no-full", action="store_true", help="skip the 'after, full head' mode")
    ap.add_argument("--profile", action="store_true", help="print a torch.profiler table of one 'after' step")
    ap.add_argument("--coverage", action="store_true", help="also measure the stdlib-proxy coverage at several N")
    ap.add_argument("--out", default=None, help="directory for results.json / results.md")
    args = ap.parse_args()

    import torch

    from pydflash.fetch import registry as models
    from pydflash.reference.model import DFlashDrafter, TargetWeights
    from pydflash.train import trainer as new
    from pydflash.train.features import FeatureCache
    from pydflash.train.init import init_from_target, target_facts
    from pydflash.train.pipeline import build_config

    torch.set_num_threads(args.threads)
    old = load_old_trainer(args.before_rev)
    target_path = str(models.resolve(args.model))
    facts = target_facts(target_path)
    cache = FeatureCache(args.cache)
    config = build_config(facts, taps=cache.tap_layers)
    weights = TargetWeights.from_gguf(target_path)
    seqs = cache.sequences(decode=False)
    model0 = DFlashDrafter(config)
    init_from_target(model0, target_path, seed=0)
    state = model0.state_dict()
    common = dict(steps=10_000, seqs_per_step=args.seqs_per_step, anchors_per_seq=args.anchors_per_seq, warmup=10)

    def make(mod, **extra):  # type: ignore[no-untyped-def]
        model = DFlashDrafter(config)
        model.load_state_dict(state)
        tmp = tempfile.mkdtemp(prefix="tt-")
        return mod.Trainer(model, weights, seqs, [], mod.TrainSettings(**common, **extra), tmp, log=lambda m: None)

    modes = {"before": make(old), "after": make(new, draft_vocab=args.draft_vocab, autocast="fp32")}
    if not args.no_full:
        modes["after, full head"] = make(new, draft_vocab=0, autocast="fp32")
    if args.bf16:
        modes["after, bf16"] = make(new, draft_vocab=args.draft_vocab, autocast="bf16")
    report = modes["after"].draft_vocab_report
    print(json.dumps({"draft_vocab": report}), flush=True)
    proxy = stdlib_coverage(target_path) if args.coverage else None
    wall: dict[str, list[float]] = {m: [] for m in modes}
    cpu: dict[str, list[float]] = {m: [] for m in modes}
    for tr in modes.values():
        for _ in range(args.warmup):
            tr.train_step()
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as prof:
            modes["after"].train_step()
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25), flush=True)
    for r in range(args.rounds):
        for name, tr in modes.items():
            c0, t0 = time.process_time(), time.perf_counter()
            tr.train_step()
            wall[name].append(time.perf_counter() - t0)
            cpu[name].append(time.process_time() - c0)
        print(f"round {r + 1}: " + ", ".join(f"{m} {wall[m][-1]:.3f} s" for m in modes), flush=True)
    blocks = args.seqs_per_step * args.anchors_per_seq
    rows = []
    base = statistics.median(wall["before"])
    for name in modes:
        w, c = statistics.median(wall[name]), statistics.median(cpu[name])
        rows.append({"mode": name, "s_per_step": round(w, 4), "cpu_s_per_step": round(c, 4),
                     "blocks_per_s": round(blocks / w, 1), "blocks_per_cpu_hour": round(blocks / w * 3600 / args.threads),
                     "speedup": round(base / w, 2)})
    meta = {"cpu": cpu_name(), "flags": cpu_flags(), "threads": args.threads, "torch": torch.__version__,
            "model": args.model, "cache_tokens": cache.n_tokens, "sequences": len(seqs), "rounds": args.rounds,
            "blocks_per_step": blocks, "before_rev": args.before_rev, "draft_vocab": report, "stdlib_coverage": proxy,
            "command": "python " + " ".join(sys.argv)}
    lines = [f"CPU: {meta['cpu']} ({meta['flags']}), {args.threads} threads, torch {torch.__version__}",
             f"{args.model}, default drafter config, {blocks} blocks/step "
             f"({args.seqs_per_step} seqs x {args.anchors_per_seq} anchors), cache {cache.n_tokens} tokens "
             f"in {len(seqs)} sequences, medians of {args.rounds} interleaved rounds", "",
             "| mode | s/step | CPU s/step | blocks/s | blocks per CPU-hour | vs before |",
             "|---|---|---|---|---|---|"]
    lines += [f"| {r['mode']} | {r['s_per_step']:.3f} | {r['cpu_s_per_step']:.3f} | {r['blocks_per_s']:.1f} | "
              f"{r['blocks_per_cpu_hour']:,} | {r['speedup']:.2f}x |" for r in rows]
    if proxy:
        lines += ["", f"Draft vocabulary coverage, stdlib source as a proxy ({proxy['calibration_tokens']:,} calibration "
                  f"tokens, {proxy['held_out_tokens']:,} held-out tokens from other files):", "",
                  "| N | " + " | ".join(proxy["held_out_coverage"]) + " |", "|---" * (1 + len(proxy["held_out_coverage"])) + "|",
                  "| held-out coverage | " + " | ".join(f"{100 * v:.2f} %" for v in proxy["held_out_coverage"].values()) + " |"]
    if report:
        lines += ["", f"This cache's labels: {report['train_labels']:,} on continuations, "
                  f"{report['distinct_train_labels']:,} distinct (all covered at N = {report['n']})"
                  if report["train_coverage"].get(str(report["n"])) == 1.0 else
                  f"This cache's labels at N = {report['n']}: coverage {report['train_coverage'].get(str(report['n']))}"]
    text = "\n".join(lines)
    print(text)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "results.json").write_text(json.dumps({"meta": meta, "rows": rows, "wall": wall, "cpu": cpu}, indent=1))
        (out / "results.md").write_text(f"```sh\n{meta['command']}\n```\n\n{text}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
