"""Requests/s and tokens/s at 1, 4 and 8 concurrent clients: `pydflash serve` and the shipped
upstream llama-server, same target and drafter files, same run, loopback only, bounded.

    python benchmarks/serve_load.py [-m smollm2-135m] [--requests 16] [-n 32]

The drafter is a tiny random DFlash2 (Q4_K_M) made for the target (no trained drafter ships
yet), so both servers draft and nearly always reject: this measures serving overhead and
batching, not speculative speedup.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from fixtures_tiny import smollm2_drafter_config, write_checkpoint  # noqa: E402
from pydflash.tools.upstream_server import free_port, post_json, wait_healthy  # noqa: E402

from pydflash.fetch import registry as models  # noqa: E402
from pydflash.tools.upstream_binaries import tool_path  # noqa: E402
from pydflash.formats.convert import convert  # noqa: E402
from pydflash.formats.quantize import quantize  # noqa: E402


def load(base: str, clients: int, requests: int, n_predict: int) -> dict:
    def one(i: int) -> int:
        body = {"prompt": f"Write item {i} of a shopping list:", "n_predict": n_predict, "temperature": 0,
                "ignore_eos": True, "cache_prompt": False}
        return post_json(base + "/completion", body, timeout=600)["timings"]["predicted_n"]

    t0 = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        tokens = sum(pool.map(one, range(requests)))
    wall = time.perf_counter() - t0
    return {"clients": clients, "requests_per_s": round(requests / wall, 2), "tokens_per_s": round(tokens / wall, 1)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("-m", "--model", default="smollm2-135m")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("-n", type=int, default=32)
    args = ap.parse_args()
    target = models.resolve(args.model)
    tmp = Path(tempfile.mkdtemp())
    write_checkpoint(tmp / "hf", smollm2_drafter_config(block_size=4), seed=3)
    f16 = convert(tmp / "hf", tmp / "drafter-f16.gguf", target_gguf=target, outtype="f16", progress=False)
    drafter = quantize(f16, tmp / "drafter-q4_k_m.gguf", "Q4_K_M", progress=False)
    common = ["-m", str(target), "-md", str(drafter), "--spec-type", "draft-dflash", "--spec-draft-n-max", "3",
              "-np", "8", "-c", "8192", "-t", "2", "--host", "127.0.0.1"]
    servers = {
        "pydflash serve": [sys.executable, "-m", "pydflash.server", *common],
        "llama-server": [str(tool_path("llama-server")), *common, "--fit", "off", "--no-warmup"],
    }
    results = {}
    for name, cmd in servers.items():
        port = free_port()
        proc = subprocess.Popen([*cmd, "--port", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        base = f"http://127.0.0.1:{port}"
        try:
            wait_healthy(base, proc, timeout=300)
            load(base, 1, 2, 8)  # warm up
            results[name] = [load(base, c, args.requests, args.n) for c in (1, 4, 8)]
        finally:
            proc.terminate()
            proc.wait(timeout=60)
    print(json.dumps({"target": target.name, "drafter": "tiny random DFlash2 Q4_K_M", "n_predict": args.n,
                      "requests": args.requests, "results": results}, indent=2))


if __name__ == "__main__":
    main()
