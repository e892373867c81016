"""Plain greedy decoding speed: `pydflash` (our target engine) next to the shipped upstream
llama-server on the same GGUF, interleaved in one run; medians of several prompts.

    python benchmarks/plain_vs_llama_server.py -m smollm2-135m -n 128 -t 2
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import subprocess
import time
import urllib.request

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
    args = ap.parse_args()
    path = models.resolve(args.model)
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
            for prompt in PROMPTS:
                r = target.generate(prompt, max_tokens=args.n, temperature=0, ignore_eos=True)
                ours.append(r.stats.tokens_per_second)
                u = post(base + "/completion", {"prompt": prompt, "n_predict": args.n, "temperature": 0,
                                                "ignore_eos": True, "cache_prompt": False})
                upstream.append(u["timings"]["predicted_per_second"])
    finally:
        server.terminate()
        server.wait()
    print(json.dumps({
        "model": path.name, "threads": args.t, "n_predict": args.n,
        "pydflash_tok_s_median": round(statistics.median(ours), 1),
        "llama_server_tok_s_median": round(statistics.median(upstream), 1),
        "ratio": round(statistics.median(ours) / statistics.median(upstream), 3),
        "pydflash_tok_s": [round(x, 1) for x in ours],
        "llama_server_tok_s": [round(x, 1) for x in upstream],
    }, indent=2))


if __name__ == "__main__":
    main()
