"""Soak: `pydflash serve` under 8 concurrent clients for 1,000 requests (loopback only, bounded).

    python benchmarks/soak_serve.py [--requests 1000] [--clients 8] [--drafter tiny|shipped|none] [--n-max 3]

Requests rotate through /v1/completions, /v1/chat/completions and /completion, streaming and
not, with max_tokens 8..16 and ignore_eos; every 10th streaming request is dropped by the
client after its first chunk (a cancellation). A request counts as failed when it gets a
non-200 status, a malformed body, a stream without its end marker, or (non-streaming) fewer
tokens than asked for: with ignore_eos every answer must be exactly max_tokens long.

Reported: failed requests, requests/s, the server's RSS sampled every 50 requests (growth after
warm-up must be flat), and its thread count idle after warm-up vs idle at the end (no leak).
The target is SmolLM2-135M; the drafter a tiny random DFlash2 made for it (``--drafter tiny``,
the default), the DFlash2 drafter shipped for it (``--drafter shipped``), or none (plain), drafting
``--n-max`` tokens per step (``auto``: the scheduler's choice).
"""

from __future__ import annotations

import argparse
import http.client
import json
import random
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from fixtures_tiny import smollm2_drafter_config, write_checkpoint  # noqa: E402
from pydflash.tools.upstream_server import free_port, wait_healthy  # noqa: E402

from pydflash import drafters  # noqa: E402
from pydflash.fetch import registry as models  # noqa: E402
from pydflash.formats.convert import convert  # noqa: E402

PROMPTS = ["Write a haiku about the sea.", "def quicksort(xs):", "List three prime numbers:",
           "The capital of France is", "Explain recursion in one sentence.", "Once upon a time",
           "import numpy as np\n", "Translate 'good morning' to Spanish:"]
TIMEOUT = 300  # seconds for one request: bounds the whole run


def proc_status(pid: int) -> dict[str, int]:
    """RSS (KiB) and thread count of a process, from /proc."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "Threads"):
            out[key] = int(value.split()[0])
    return out


def request_body(i: int, rng: random.Random) -> tuple[str, dict, bool, bool]:
    """(path, body, stream, cancel) of request i."""
    n = rng.randint(8, 16)
    prompt = PROMPTS[i % len(PROMPTS)]
    kind = i % 6
    stream = kind in (1, 3, 5)
    cancel = stream and i % 10 == 5
    sampling = {"temperature": 0.0} if i % 3 else {"temperature": 0.8, "seed": i}
    if kind in (0, 1):
        return "/v1/completions", {"prompt": prompt, "max_tokens": n, "stream": stream, "ignore_eos": True,
                                   **sampling}, stream, cancel
    if kind in (2, 3):
        return "/v1/chat/completions", {"messages": [{"role": "user", "content": prompt}], "max_tokens": n,
                                        "stream": stream, "ignore_eos": True, **sampling}, stream, cancel
    return "/completion", {"prompt": prompt, "n_predict": n, "stream": stream, "ignore_eos": True,
                           "cache_prompt": False, **sampling}, stream, cancel


def expected_tokens(path: str, body: dict) -> int:
    return body["n_predict"] if path == "/completion" else body["max_tokens"]


def check_plain(path: str, body: dict, data: dict) -> str | None:
    """None if a non-streaming answer is complete, else what is wrong."""
    n = expected_tokens(path, body)
    if path == "/completion":
        got, text = data["timings"]["predicted_n"], data["content"]
    else:
        got = data["usage"]["completion_tokens"]
        choice = data["choices"][0]
        text = choice["text"] if path == "/v1/completions" else choice["message"]["content"]
    if got != n or not isinstance(text, str):
        return f"{got} tokens for max {n}"
    return None


def one(port: int, i: int, rng_seed: int) -> tuple[str, str | None]:
    """Run request i; returns (outcome, problem): outcome 'ok', 'cancelled' or 'failed'."""
    path, body, stream, cancel = request_body(i, random.Random(rng_seed + i))
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=TIMEOUT)
    try:
        conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            return "failed", f"HTTP {resp.status}: {resp.read()[:200]!r}"
        if not stream:
            return ("failed", problem) if (problem := check_plain(path, body, json.loads(resp.read()))) else ("ok", None)
        events = 0
        while True:
            line = resp.readline()
            if not line:
                return "failed", f"stream ended without its end marker after {events} events"
            line = line.strip()
            if not line.startswith(b"data: "):
                continue
            events += 1
            if cancel:
                return "cancelled", None  # the connection is closed below, mid-stream
            payload = line[len(b"data: "):]
            if payload == b"[DONE]":
                return "ok", None
            chunk = json.loads(payload)
            if path == "/completion" and chunk.get("stop"):
                return "ok", None
    except Exception as exc:  # noqa: BLE001 - every failure is counted, none stops the run
        return "failed", f"{type(exc).__name__}: {exc}"
    finally:
        conn.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("-m", "--model", default="smollm2-135m")
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=100, help="requests before the baseline RSS/threads sample")
    ap.add_argument("--drafter", choices=("tiny", "shipped", "none"), default="tiny")
    ap.add_argument("--no-drafter", action="store_true", help="as --drafter none")
    ap.add_argument("--n-max", default="3", help="--spec-draft-n-max of the server (default 3; auto)")
    ap.add_argument("-t", "--threads", type=int, default=1,
                    help="server threads (1: ggml's spinning pool collapses on a loaded 2-core machine)")
    args = ap.parse_args()
    if args.no_drafter:
        args.drafter = "none"
    target = models.resolve(args.model)
    tmp = Path(tempfile.mkdtemp(prefix="pydflash-soak-"))
    cmd = [sys.executable, "-m", "pydflash.cli", "serve", "-m", str(target), "-np", str(args.clients),
           "-c", str(512 * args.clients), "-t", str(args.threads), "--host", "127.0.0.1"]
    drafter_name = None
    if args.drafter == "tiny":
        write_checkpoint(tmp / "hf", smollm2_drafter_config(block_size=4), seed=3)
        drafter = convert(tmp / "hf", tmp / "drafter.gguf", target_gguf=target, outtype="f16", progress=False)
        drafter_name = f"tiny random DFlash2 F16 (block 4, n_max {args.n_max})"
    elif args.drafter == "shipped":
        drafter = Path(drafters.__file__).parent / "smollm2-135m-instruct-dflash2.gguf"
        drafter_name = f"shipped {drafter.name} (n_max {args.n_max})"
    if drafter_name is not None:
        cmd += ["-md", str(drafter), "--spec-type", "draft-dflash", "--spec-draft-n-max", str(args.n_max)]
    port = free_port()
    log = tmp / "server.log"
    with open(log, "wb") as log_file:
        proc = subprocess.Popen([*cmd, "--port", str(port)], stdout=log_file, stderr=subprocess.STDOUT)
    samples: list[dict] = []
    outcomes = {"ok": 0, "cancelled": 0, "failed": 0}
    problems: list[str] = []
    lock = threading.Lock()
    done = 0
    try:
        wait_healthy(f"http://127.0.0.1:{port}", proc, timeout=300, log=log)
        start_status = proc_status(proc.pid)
        baseline: dict[str, int] = {}
        t0 = time.perf_counter()

        def run(i: int) -> None:
            nonlocal done
            outcome, problem = one(port, i, 1234)
            with lock:
                outcomes[outcome] += 1
                if problem:
                    problems.append(f"request {i}: {problem}")
                done += 1
                if done % 100 == 0:
                    print(f"{done} requests, {outcomes}", file=sys.stderr, flush=True)
                if done % 50 == 0:
                    samples.append({"requests": done, "rss_mib": round(proc_status(proc.pid)["VmRSS"] / 1024, 1),
                                    "threads": proc_status(proc.pid)["Threads"]})

        with ThreadPoolExecutor(args.clients) as pool:
            list(pool.map(run, range(args.warmup)))
        time.sleep(1.0)  # let cancelled generations finish: an idle server
        baseline = proc_status(proc.pid)
        t1 = time.perf_counter()
        with ThreadPoolExecutor(args.clients) as pool:
            list(pool.map(run, range(args.warmup, args.requests)))
        wall = time.perf_counter() - t1
        time.sleep(1.0)
        end = proc_status(proc.pid)
        alive = proc.poll() is None
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    after_warmup = [s["rss_mib"] for s in samples if s["requests"] > args.warmup]
    report = {
        "target": target.name,
        "drafter": drafter_name,
        "clients": args.clients,
        "requests": args.requests,
        "outcomes": outcomes,
        "failed_examples": problems[:10],
        "server_alive_at_end": alive,
        "requests_per_s_after_warmup": round((args.requests - args.warmup) / wall, 2),
        "total_wall_s": round(time.perf_counter() - t0, 1),
        "rss_mib": {"after_start": round(start_status["VmRSS"] / 1024, 1),
                    "after_warmup": round(baseline["VmRSS"] / 1024, 1),
                    "end": round(end["VmRSS"] / 1024, 1),
                    "min_max_after_warmup": [min(after_warmup, default=0), max(after_warmup, default=0)]},
        "threads": {"after_start": start_status["Threads"], "after_warmup_idle": baseline["Threads"],
                    "end_idle": end["Threads"]},
        "samples": samples,
    }
    print(json.dumps(report, indent=2))
    sys.exit(0 if outcomes["failed"] == 0 and alive else 1)


if __name__ == "__main__":
    main()
