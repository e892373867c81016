"""Runs drafter / engine work on a ggml RPC device in its own process (used by test_devices.py).

Adding an RPC server registers its devices for the rest of the process: every later target
context would open a backend on them, and a server that has gone away aborts the process on
the next device query. So each RPC job runs here, in a child, and writes its results to a file
that the test compares against references computed in the test process.

    python rpc_worker.py ENDPOINT JOB.json OUT.npz
"""

from __future__ import annotations

import json
import sys

import numpy as np

from pydflash import Drafter, Engine
from pydflash.runtime import devices


def drafter_job(job: dict, device: str) -> dict[str, np.ndarray]:
    """inject + forward + greedy proposal for each anchor (fresh context each time)."""
    feats = np.load(job["features"])
    out: dict[str, np.ndarray] = {}
    with Drafter(job["drafter"], job["target"], n_ctx=256, n_threads=1, exact_head=job["exact_head"],
                 device=device) as d:
        out["device"] = np.array(d.info.device)
        for i, (n_ctx, anchor) in enumerate(job["blocks"]):
            d.crop(0)
            d.inject(feats[:n_ctx], np.arange(n_ctx))
            hidden, logits = d.forward(anchor, n_ctx, job["n_block"])
            proposal = d.propose(anchor, n_ctx, job["n_block"], temperature=0.0)
            out[f"hidden{i}"], out[f"logits{i}"], out[f"tokens{i}"] = hidden, logits, proposal.tokens
    return out


def engine_job(job: dict, device: str) -> dict[str, np.ndarray]:
    """Greedy generations: speculative with the drafter on the device (the target offloaded to it
    with n_gpu_layers), and plain decoding of the same target for the losslessness check."""
    out: dict[str, np.ndarray] = {}
    with Engine(job["target"], job["drafter"], n_ctx=512, n_threads=1, n_gpu_layers=job["n_gpu_layers"],
                n_max=job["n_max"], drafter_device=job["drafter_device"]) as engine:
        out["device"] = np.array(engine.drafter.info.device)
        for i, prompt in enumerate(job["prompts"]):
            tokens = engine.target.tokenize(prompt)
            spec = engine.generate(tokens, max_tokens=job["max_tokens"], temperature=0, ignore_eos=True)
            plain = engine.target.generate(tokens, max_tokens=job["max_tokens"], temperature=0, ignore_eos=True)
            out[f"spec{i}"], out[f"plain{i}"] = np.array(spec.tokens), np.array(plain.tokens)
            out[f"drafted{i}"] = np.array(spec.stats.n_drafted)
    return out


def main() -> int:
    endpoint, job_path, out_path = sys.argv[1:4]
    with open(job_path) as f:
        job = json.load(f)
    added = devices.add_rpc_server(endpoint)
    device = added[0].name
    work = drafter_job if job["kind"] == "drafter" else engine_job
    if job["kind"] == "engine" and job["drafter_device"] == "rpc":
        job["drafter_device"] = device
    np.savez(out_path, **work(job, device))
    return 0


if __name__ == "__main__":
    sys.exit(main())
