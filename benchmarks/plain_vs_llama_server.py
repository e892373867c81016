"""Plain greedy decoding speed: `pydflash` (our target engine) next to the shipped upstream
llama-server on the same GGUF, interleaved in one run; medians of several prompts.

    python benchmarks/plain_vs_llama_server.py -m smollm2-135m -n 128 -t 2 --rounds 3 \
        --out benchmarks/results/plain-vs-llama-server

Both sides run greedy with ``ignore_eos`` and no prompt cache; each prompt is run by pydflash, then
by llama-server, round after round. pydflash runs with the default kernels unless
``PYDFLASH_KERNELS=0`` is set; tok/s is decode only on both sides (prompt processing excluded).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from pydflash import Target
from pydflash.fetch import registry as models
from pydflash.tools.upstream_binaries import tool_path

PROMPTS = [
    "def quicksort(arr):",
    "The history of the printing press",
    "Write a haiku about autumn.\n",
    "import numpy as np\n\ndef normalize(x):",
    "Q: Why is the sky blue?\nA:",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.loads(r.read())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("-m", "--model", default="smollm2-135m")
    ap.add_argument("-n", type=int, default=128)
    ap.add_argument("-t", type=int, default=2)
    ap.add_argument("-c", type=int, default=2048)
    ap.add_argument("--rounds", type=int, default=1, help="passes over the prompts (medians over all runs)")
    ap.add_argument("--out", type=Path, default=None, help="folder: <model>.json is written there")
    args = ap.parse_args()
    path = models.resolve(args.model)
    load = os.getloadavg()[0]
    port = free_port()
    server = subprocess.Popen([str(tool_path("llama-server")), "-m", str(path), "--port", str(port), "--host",
                               "127.0.0.1", "-t", str(args.t), "-c", str(args.c), "-np", "1", "--no-webui"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    for _ in range(240):
        try:
            urllib.request.urlopen(base + "/health", timeout=1)
            break
        except OSError:
            time.sleep(0.5)
    ours, upstream = [], []
    try:
        with Target(path, n_ctx=args.c, n_threads=args.t) as target:
            target.generate("warm up", max_tokens=8, temperature=0)
            post(base + "/completion", {"prompt": "warm up", "n_predict": 8, "temperature": 0})
            for prompt in PROMPTS * args.rounds:
                r = target.generate(prompt, max_tokens=args.n, temperature=0, ignore_eos=True)
                ours.append(r.stats.tokens_per_second)
                u = post(base + "/completion", {"prompt": prompt, "n_predict": args.n, "temperature": 0,
                                                "ignore_eos": True, "cache_prompt": False})
                upstream.append(u["timings"]["predicted_per_second"])
    finally:
        server.terminate()
        server.wait()
    flags = sorted({f for f in Path("/proc/cpuinfo").read_text().split() if f in ("avx2", "avx512f", "avx512_vnni")})
    report = {
        "command": "python benchmarks/plain_vs_llama_server.py " + " ".join(sys.argv[1:]),
        "cpu_flags": flags, "pydflash_kernels": os.environ.get("PYDFLASH_KERNELS", "default"),
        "load_before": round(load, 2),
        "model": path.name, "threads": args.t, "n_predict": args.n, "runs": len(ours),
        "pydflash_tok_s_median": round(statistics.median(ours), 1),
        "llama_server_tok_s_median": round(statistics.median(upstream), 1),
        "ratio": round(statistics.median(ours) / statistics.median(upstream), 3),
        "median_pair_ratio": round(statistics.median(a / b for a, b in zip(ours, upstream)), 3),
        "pydflash_tok_s": [round(x, 1) for x in ours],
        "llama_server_tok_s": [round(x, 1) for x in upstream],
    }
    print(json.dumps(report, indent=2))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"{args.model}.json").write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
