"""`pydflash serve` vs the shipped upstream llama-server: head-of-line latency and throughput
under 1..16 concurrent clients, plain and speculative (same target and drafter files), loopback
only, every request loop bounded.

(a) head-of-line: a 600-token generation runs; 1 s later a request for 8 tokens is sent; its
    latency is reported (pydflash vs llama-server, same -np).
(b) for each concurrency c: 2c requests (at least 4) of n tokens from c client threads;
    aggregate generated tok/s (sum of tokens / wall) and p50 / p95 request latency.

    python benchmarks/serve_concurrency.py -m smollm2-135m -n 64 --clients 1,2,4,8,16 \
        --out benchmarks/results/serve-concurrency-smollm2
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from pydflash.tools.upstream_server import free_port, post_json, wait_healthy  # noqa: E402

from pydflash.fetch import registry as models  # noqa: E402
from pydflash.tools.upstream_binaries import tool_path  # noqa: E402

SHIPPED = Path(__file__).resolve().parents[1] / "pydflash" / "drafters" / "smollm2-135m-instruct-dflash2.gguf"


def start(kind: str, spec: bool, args: argparse.Namespace, n_slots: int, n_ctx: int) -> tuple[subprocess.Popen, str]:
    port = free_port()
    common = ["-m", str(models.resolve(args.model)), "-np", str(n_slots), "-c", str(n_ctx), "-t", str(args.threads),
              "--host", "127.0.0.1", "--port", str(port)]
    if spec:
        common += ["-md", str(args.model_draft), "--spec-type", "draft-dflash", "--spec-draft-n-max",
                   "auto" if kind == "pydflash" else str(args.upstream_n_max)]
        if kind == "upstream":
            common += ["-td", str(args.threads), "--spec-draft-n-min", "0"]
    if kind == "pydflash":
        cmd = [sys.executable, "-m", "pydflash.server", *common]
    else:
        cmd = [str(tool_path("llama-server")), *common, "--fit", "off", "-tb", str(args.threads)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    wait_healthy(base, proc, timeout=300)
    return proc, base


def completion(base: str, prompt: str, n: int) -> tuple[float, int]:
    body = {"prompt": prompt, "n_predict": n, "temperature": 0, "ignore_eos": True, "cache_prompt": False}
    t0 = time.perf_counter()
    out = post_json(base + "/completion", body, timeout=900)
    return time.perf_counter() - t0, int(out["timings"]["predicted_n"])


def head_of_line(base: str) -> dict:
    done: dict = {}

    def long() -> None:
        done["long"] = completion(base, "Write a very long story about a dragon and a knight.", 600)

    t = threading.Thread(target=long)
    t.start()
    time.sleep(1.0)
    short_s, _ = completion(base, "The capital of France is", 8)
    t.join()
    return {"short_latency_s": round(short_s, 3), "long_latency_s": round(done["long"][0], 2)}


def sweep(base: str, clients: int, n: int) -> dict:
    requests = max(4, 2 * clients)
    prompts = [f"Write item {i} of a shopping list for a picnic:" for i in range(requests)]
    t0 = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        results = list(pool.map(lambda p: completion(base, p, n), prompts))
    wall = time.perf_counter() - t0
    lat = sorted(r[0] for r in results)
    return {"clients": clients, "tok_s": round(sum(r[1] for r in results) / wall, 1),
            "p50_s": round(statistics.median(lat), 3), "p95_s": round(lat[min(len(lat) - 1, int(0.95 * len(lat)))], 3)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", default="smollm2-135m")
    ap.add_argument("-md", "--model-draft", default=str(SHIPPED))
    ap.add_argument("-n", type=int, default=64)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--clients", default="1,2,4,8,16")
    ap.add_argument("--upstream-n-max", type=int, default=3, help="llama-server's fixed --spec-draft-n-max")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    levels = [int(x) for x in args.clients.split(",")]
    report: dict = {"command": " ".join(sys.argv), "head_of_line": {}, "sweep": {}}
    for spec in (False, True):
        for kind in ("pydflash", "upstream"):
            name = f"{kind}-{'spec' if spec else 'plain'}"
            proc, base = start(kind, spec, args, n_slots=4, n_ctx=4 * 2048)
            try:
                completion(base, "warm up", 4)
                report["head_of_line"][name] = head_of_line(base)
            finally:
                proc.terminate()
                proc.wait(timeout=60)
            print(name, "head-of-line", report["head_of_line"][name], flush=True)
            proc, base = start(kind, spec, args, n_slots=max(levels), n_ctx=max(levels) * 1024)
            try:
                completion(base, "warm up", 4)
                rows = []
                for c in levels:
                    rows.append(sweep(base, c, args.n))
                    print(name, rows[-1], flush=True)
                report["sweep"][name] = rows
            finally:
                proc.terminate()
                proc.wait(timeout=60)
    lines = [f"Command: `{report['command']}`", "", "Head-of-line (8-token request 1 s into a 600-token one, -np 4):", "",
             "| server | short request latency (s) | long request (s) |", "|---|---|---|"]
    for name, h in report["head_of_line"].items():
        lines.append(f"| {name} | {h['short_latency_s']} | {h['long_latency_s']} |")
    lines += ["", f"Throughput, {args.n} tokens per request, 2c requests (>= 4) from c clients:", "",
              "| server | " + " | ".join(f"c={c} tok/s (p50/p95 s)" for c in levels) + " |",
              "|---|" + "---|" * len(levels)]
    for name, rows in report["sweep"].items():
        lines.append(f"| {name} | " + " | ".join(f"{r['tok_s']} ({r['p50_s']}/{r['p95_s']})" for r in rows) + " |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.json").write_text(json.dumps(report, indent=1))
        (args.out / "results.md").write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
