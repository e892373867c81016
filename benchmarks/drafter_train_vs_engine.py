"""Does the trained drafter accept in the native engine what the trainer says it accepts?

Captures the held-out HumanEval 132..163 continuations into their own cache (never trained on),
then, for a training run's ``checkpoint.pt``:

* ``uniform_anchor_tau``: the trainer's teacher-forced greedy acceptance with an anchor at every
  continuation position (what the training log's ``val_tau`` measures, on random anchors);
* ``walk_tau``: the same per-anchor acceptances walked as the engine steps (anchor a, k accepted
  -> next anchor a + k + 1, at most n_max drafts, 128 tokens);
* ``native``: the engine's tau for the run's exported GGUF files (greedy, n_max 7).

``walk_tau`` close to the native BF16 tau means training and inference agree; the uniform-anchor
figure is higher because easy stretches are crossed in few engine steps but hold many anchors.

    python benchmarks/drafter_train_vs_engine.py --run runs/smollm2-s4 --target smollm2-135m \\
        --cache /tmp/heldout-cache runs/smollm2-s4/*-BF16.gguf runs/smollm2-s4/*-Q4_K_M.gguf
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import numpy as np
import torch

from pydflash.fetch import registry as models
from pydflash.reference.model import DFlashDrafter, TargetWeights
from pydflash.train import curve
from pydflash.train import prompts as train_prompts
from pydflash.train.features import FeatureCache
from pydflash.train.init import target_facts
from pydflash.train.pipeline import _eog_ids, build_config, capture, load_portable
from pydflash.train.trainer import Trainer, TrainSettings, make_batch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", type=Path, default=None, help="training --out folder (its checkpoint.pt)")
    ap.add_argument("--portable", default=None, help="or a portable checkpoint (pydflash train --save-portable)")
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--block-size", type=int, default=8)
    ap.add_argument("--draft-vocab", type=int, default=8192)
    ap.add_argument("--cache", type=Path, required=True, help="feature cache of the held-out continuations")
    ap.add_argument("--n-max", type=int, default=7)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("gguf", nargs="*", help="exported drafters to run in the native engine")
    args = ap.parse_args()
    if (args.run is None) == (args.portable is None):
        ap.error("give --run or --portable")
    torch.set_num_threads(args.threads)
    tp = str(models.resolve(args.target))
    config = build_config(target_facts(tp), layers=args.layers, block_size=args.block_size)
    capture(tp, train_prompts.held_out_humaneval(), args.cache, config.target_layer_ids, max_new=args.max_tokens,
            threads=args.threads, batch=4)
    seqs = FeatureCache(args.cache).sequences(decode=False)
    model = DFlashDrafter(config)
    tr = Trainer(model, TargetWeights.from_gguf(tp), seqs, seqs,
                 TrainSettings(steps=1, draft_vocab=args.draft_vocab, max_len=1 << 20),
                 args.run or Path(tempfile.mkdtemp()), eog_ids=_eog_ids(tp))
    if args.portable:
        load_portable(tr, args.portable)
    elif not tr.load_checkpoint():
        raise SystemExit(f"no checkpoint.pt in {args.run}")
    model.eval()
    uniform: list[int] = []
    walk_steps = walk_tokens = 0
    walk_pos = np.zeros(args.n_max)
    for s in tr.val_seqs:
        anchors = np.arange(s.prompt_len - 1, len(s.tokens) - 1)  # anchors[1] = the first generated token
        b = make_batch([s], [anchors], args.block_size, config.mask_token_id)
        acc, _ = tr.accepted_drafts(b)
        acc = acc.numpy()
        uniform += acc[1:].tolist()
        a, n_gen = 1, 1  # the first token comes from the prompt's decode
        while a < len(anchors) and n_gen < args.max_tokens:
            k = min(int(acc[a]), args.n_max, args.max_tokens - n_gen - 1)
            walk_pos[:k] += 1
            walk_steps += 1
            walk_tokens += k + 1
            n_gen += k + 1
            a += k + 1
    report = {"run": str(args.run or args.portable), "step": tr.step, "sequences": len(tr.val_seqs),
              "uniform_anchor_tau": round(1 + float(np.mean(uniform)), 4),
              "walk_tau": round(walk_tokens / walk_steps, 4),
              "walk_accepted_per_position": (walk_pos / walk_steps).round(4).tolist(), "native": {}}
    for f in args.gguf:
        r = curve.heldout_tau(tp, f, n_max=args.n_max, max_tokens=args.max_tokens, threads=args.threads)
        steps = r["verify_steps"]
        report["native"][Path(f).name] = {"tau": round(r["tau"], 4), "accepted_per_position":
                                          [round(x / steps, 4) for x in r["accepted_per_position"]]}
    print(json.dumps(report, indent=1))
    if args.out:
        args.out.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
