"""Does the drafter copy from the sequence's own history where the history predicts the next token?

For every continuation anchor s of the held-out HumanEval 132..163 continuations (captured into
their own cache, never trained on), or of the first ``--limit`` sequences of another feature
cache, compares the drafter's first draft (teacher-forced, slot 1, the trainer's float32 forward
of a portable checkpoint) with two history lookups of the token at s + 1:

* ``lookup``: the token after the latest earlier occurrence of the longest suffix (up to 4 tokens)
  of the tokens ending at s, as the engine's lookup drafts (``benchmarks/lookup_simulation.py``);
* ``lookup2``: the same, requiring a match of at least 2 tokens;

and reports, for each query head of the last layer, the mean attention mass slot 1 puts on the
rows j < s whose token is the anchor's and whose successor is the right token (the rows a copy
would read: row j carries the target's prediction for j + 1), and on the rows j + 1 after them
(each holds the right token itself).

    python benchmarks/drafter_copy_diagnosis.py CHECKPOINT.pt --cache /tmp/heldout-cache \\
        [--layers 1] [--out result.json]
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
from pydflash.train import prompts as train_prompts
from pydflash.train.features import FeatureCache
from pydflash.train.forward import forward_blocks
from pydflash.train.init import target_facts
from pydflash.train.pipeline import _eog_ids, build_config, capture, load_portable
from pydflash.train.trainer import Trainer, TrainSettings, make_batch


def lookup(tokens: list[int], s: int, min_match: int, max_match: int = 4) -> int | None:
    """The token after the latest j < s whose last m tokens equal those ending at s, longest m first."""
    for m in range(max_match, min_match - 1, -1):
        if s - m + 1 < 0:
            continue
        key = tokens[s - m + 1:s + 1]
        for j in range(s - 1, m - 2, -1):
            if tokens[j - m + 1:j + 1] == key:
                return tokens[j + 1]
    return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint", help="a portable checkpoint (pydflash train --save-portable)")
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--cache", type=Path, required=True,
                    help="feature cache: the held-out continuations are captured into it unless --limit is given")
    ap.add_argument("--limit", type=int, default=None, help="use the first N sequences of an existing cache instead")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    tp = str(models.resolve(args.target))
    config = build_config(target_facts(tp), layers=args.layers, block_size=8)
    if args.limit is None:
        capture(tp, train_prompts.held_out_humaneval(), args.cache, config.target_layer_ids, max_new=128,
                threads=args.threads, batch=4)
    seqs = FeatureCache(args.cache).sequences(decode=False)[:args.limit]
    model = DFlashDrafter(config)
    tr = Trainer(model, TargetWeights.from_gguf(tp), seqs, seqs, TrainSettings(steps=1, max_len=1 << 20),
                 Path(tempfile.mkdtemp()), eog_ids=_eog_ids(tp))
    load_portable(tr, args.checkpoint)
    model.eval()
    rows, masses, succ_masses = [], [], []
    for seq in tr.val_seqs:
        tokens = [int(t) for t in seq.tokens]
        anchors = np.arange(seq.prompt_len - 1, len(tokens) - 2)
        b = make_batch([seq], [anchors], config.block_size, config.mask_token_id)
        probes: list[torch.Tensor] = []
        with torch.no_grad():
            for head in range(config.num_attention_heads):
                out: list[torch.Tensor] = []
                forward_blocks(model, b.features, b.block_tokens, b.anchors, tr.target, with_logits=False,
                               probe=(head, out))
                probes.append(out[0][0])  # [A, n]
        acc, _ = tr.accepted_drafts(b)
        for i, s in enumerate(anchors.tolist()):
            y = tokens[s + 1]
            l1, l2 = lookup(tokens, s, 1), lookup(tokens, s, 2)
            rows.append((acc[i] >= 1, l1 is not None, l1 == y, l2 is not None, l2 == y))
            copy_rows = [j for j in range(s) if tokens[j] == tokens[s] and tokens[j + 1] == y]
            successors = [j + 1 for j in copy_rows if j + 1 < s]
            if copy_rows:
                masses.append([float(p[i, copy_rows].sum()) for p in probes])
                succ_masses.append([float(p[i, successors].sum()) for p in probes])
    r = np.array(rows, dtype=bool)
    drafter, has1, ok1, has2, ok2 = r.T
    m = np.array(masses)
    report = {
        "checkpoint": args.checkpoint, "cache": str(args.cache), "sequences": len(tr.val_seqs), "anchors": len(r),
        "drafter_first_right": drafter.mean(),
        "lookup_has_match": has1.mean(), "lookup_right": ok1.mean(),
        "lookup2_has_match": has2.mean(), "lookup2_right": ok2.mean(),
        "drafter_right_where_lookup2_right": drafter[ok2].mean(),
        "drafter_right_where_no_lookup_match": drafter[~has1].mean(),
        "drafter_wrong_lookup_right": (~drafter & ok1).mean(),
        "drafter_or_lookup_right": (drafter | ok1).mean(),
        "copy_anchors": len(m),
        "slot1_mass_on_copy_rows_per_head": m.mean(0).round(4).tolist(),
        "slot1_best_head_mass": float(m.max(1).mean()),
        # the rows after those (each holds the token that followed; --copy-successor)
        "slot1_mass_on_successor_rows_per_head": np.array(succ_masses).mean(0).round(4).tolist(),
    }
    report = {k: (round(float(v), 4) if isinstance(v, (float, np.floating)) else v) for k, v in report.items()}
    print(json.dumps(report, indent=1))
    if args.out:
        args.out.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
