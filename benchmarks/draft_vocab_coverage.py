"""Coverage of reduced draft vocabularies by size: calibrated on one prompt set, measured on the
calibration outputs and on held-out prompts' greedy outputs (what choosing N should rest on).

    python benchmarks/draft_vocab_coverage.py -m qwen2.5-coder-1.5b --calib-tokens 128 -t 1
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from pydflash import Target
from pydflash.fetch import registry as models
from pydflash.formats.draft_vocab import calibrate, choose, coverage

from draft_vocab import BENCH, CALIBRATION

HELD_OUT = BENCH + [
    "def count_vowels(s):", "def rotate_list(xs, k):", "class Queue:\n    def __init__(self):",
    "def median(values):", "def unique_sorted(xs):", "def camel_to_words(name):",
]
SIZES = (256, 512, 1024, 2048, 4096, 8192, 16384, 32768)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("-m", "--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--calib-tokens", type=int, default=128)
    ap.add_argument("--held-out-tokens", type=int, default=64)
    ap.add_argument("-t", type=int, default=1)
    args = ap.parse_args()
    with Target(models.path(args.model), n_ctx=2048, n_threads=args.t) as target:
        t0 = time.perf_counter()
        counts = calibrate(target, CALIBRATION, max_tokens=args.calib_tokens)
        calib_s = time.perf_counter() - t0
        held = calibrate(target, HELD_OUT, max_tokens=args.held_out_tokens)
        eog = [t for t in range(target.info.n_vocab) if target.is_eog(t)]
    held_tokens = np.repeat(np.arange(held.n_vocab), held.output)
    out = {
        "model": args.model,
        "calibration": {"prompts": counts.n_prompts, "tokens": counts.n_output,
                        "distinct": int(np.count_nonzero(counts.output)), "seconds": round(calib_s, 1)},
        "held_out": {"prompts": held.n_prompts, "tokens": held.n_output},
        "coverage_calibration": {str(k): round(v, 4) for k, v in coverage(counts, SIZES).items()},
        "coverage_held_out": {str(n): round(float(np.isin(held_tokens, choose(counts, n, always=eog)).mean()), 4)
                              for n in SIZES},
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
