"""Where the drafter graph's ops run on a device: ggml's scheduler assignments, op by op.

Runs one DFlash2 drafter block on --device with GGML_SCHED_DEBUG=2 (the scheduler then logs
every node's backend and why it went there) and summarises the log: per op, how many nodes ran on
the device and how many on the CPU, with the scheduler's cause codes. Nodes on the CPU whose
inputs are all on the device are ops the device backend does not support (the scheduler fell
back); the rest are on the CPU by design (inputs, the mapped token embedding, the exact head).

    python benchmarks/gpu/op_placement.py --target t.gguf --drafter d.gguf --device Vulkan0 [--out x.json]
    (lavapipe: GGML_VK_VISIBLE_DEVICES=0 GGML_VK_DISABLE_F16=1 GGML_VK_DISABLE_COOPMAT=1)

Without --drafter a tiny random DFlash2 drafter for the target is written first (the tests' fixture).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import sys
import tempfile
from pathlib import Path

import numpy as np

NODE = re.compile(r"node #\s*(\d+) \(\s*([^)]*?)\): +(\S+) \(\s*[^)]*\) \[\s*(\S+) +(\S*)\]")
HERE = Path(__file__).resolve().parent


def tiny_drafter(target: Path, out_dir: Path) -> Path:
    sys.path.insert(0, str(HERE.parent.parent / "tests"))
    import torch
    from fixtures_tiny import smollm2_drafter_config, write_checkpoint

    from pydflash.formats.convert import convert

    ckpt = out_dir / "ckpt"
    write_checkpoint(ckpt, smollm2_drafter_config(num_hidden_layers=2, block_size=8), seed=0, dtype=torch.float32)
    return convert(ckpt, out_dir / "drafter.gguf", target_gguf=target, outtype="f32", progress=False)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", required=True, type=Path)
    ap.add_argument("--drafter", type=Path)
    ap.add_argument("--device", required=True)
    ap.add_argument("--exact-head", action="store_true")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    if not args.target.is_file():
        ap.error(f"--target {args.target} does not exist")

    os.environ["GGML_SCHED_DEBUG"] = "2"
    import pydflash
    from pydflash import Drafter
    from pydflash.runtime._bindings import lib

    with tempfile.TemporaryDirectory() as tmp:
        drafter = args.drafter or tiny_drafter(args.target, Path(tmp))
        log = Path(tmp) / "sched.log"
        saved = os.dup(2)
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(fd, 2)
        try:
            lib.dflash_set_verbose(True)  # ggml's debug lines (the scheduler's) reach stderr
            with Drafter(drafter, args.target, n_ctx=128, n_threads=1, device=args.device,
                         exact_head=args.exact_head) as d:
                if d.info.device != args.device:
                    raise SystemExit(f"drafter on {d.info.device}, not {args.device}")
                n = 24
                feats = np.random.default_rng(0).standard_normal((n, d.info.n_target_layers * d.info.n_embd))
                d.inject(feats.astype(np.float32), np.arange(n))
                d.propose(7, n, d.info.block_size)
        finally:
            lib.dflash_set_verbose(False)
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(fd)
        text = log.read_text(errors="replace")
    rows = NODE.findall(text)
    if not rows:
        raise SystemExit("no scheduler node lines in the log: is this pydflash build's log level passing debug lines?\n"
                         + text[-2000:])
    ops: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for _, op, _name, backend, cause in rows:
        ops[op][f"{backend}:{cause or '-'}"] += 1
    summary = {op: dict(c) for op, c in sorted(ops.items())}
    on_cpu = sorted(op for op, c in ops.items() if any(k.startswith("CPU") for k in c))
    print(f"{len(rows)} node lines, device {args.device}; op -> backend:cause counts")
    for op, c in summary.items():
        print(f"  {op:>12}  {c}")
    print("ops with nodes on the CPU:", ", ".join(on_cpu) or "none")
    if args.out:
        args.out.write_text(json.dumps({"device": args.device, "ops": summary, "ops_on_cpu": on_cpu,
                                        "pydflash": pydflash.__version__}, indent=1) + "\n")


if __name__ == "__main__":
    main()
