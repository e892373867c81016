#!/usr/bin/env python3
"""Run llama.cpp's own server test suite against the shipped llama-server and `pydflash serve`.

The pinned tree's ``tools/server/tests`` is copied to a temp dir per run (nothing upstream is
changed or committed); ``LLAMA_SERVER_BIN_PATH`` points at ``server_wrapper.py``, which swaps the
HF models the suite asks for for local ones and execs the chosen server. Each test file runs in its
own pytest process under ``flock /tmp/cpu.lock`` (serially, no xdist).

    python benchmarks/server_conformance/run.py                       # both servers, all files
    python benchmarks/server_conformance/run.py --server pydflash --label after
    python benchmarks/server_conformance/run.py --server pydflash test_tokenize.py -k detokenize
    python benchmarks/server_conformance/run.py --report-only --label after

Outcomes go to results/llama-server.json (the reference, label-independent) and
results/pydflash-<label>.json; the table to results/report-<label>.md.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import fcntl
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
UPSTREAM = REPO / ".cache/llama-cpp-python-0.3.36/vendor/llama.cpp"
RESULTS = HERE / "results"
SERVERS = {"llama": ("llama-server", 28311), "pydflash": ("pydflash", 28312)}


def result_path(server: str, label: str) -> Path:
    return RESULTS / ("llama-server.json" if server == "llama" else f"pydflash-{label}.json")


def prepare_tree(tmp: Path) -> Path:
    """<tmp>/tools/server/tests (a copy) + <tmp>/models -> the pinned tree's models (templates)."""
    tests = tmp / "tools/server/tests"
    shutil.copytree(UPSTREAM / "tools/server/tests", tests, ignore=shutil.ignore_patterns("tmp", "__pycache__"))
    (tmp / "models").symlink_to(UPSTREAM / "models")
    (tests / "tmp").mkdir(exist_ok=True)
    shim = tmp / "llama-server"
    shim.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{HERE / "server_wrapper.py"}" "$@"\n')
    shim.chmod(0o755)
    return tests


def run_server(server: str, label: str, files: list[str], kexpr: str | None, timeout: int,
               start_timeout: int, logdir: Path, nodes: list[str] | None = None,
               lock_prefix: tuple[str, ...] = ("flock", "/tmp/cpu.lock")) -> None:
    name, port = SERVERS[server]
    out = result_path(server, label)
    RESULTS.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f"conformance-{server}-") as td:
        tests = prepare_tree(Path(td))
        env = {
            **os.environ,
            "LLAMA_SERVER_BIN_PATH": str(Path(td) / "llama-server"),
            "CONFORMANCE_TARGET": server,
            "CONFORMANCE_OUT": str(out),
            "CONFORMANCE_NOTRUN": str(Path(td) / "notrun.jsonl"),
            "CONFORMANCE_CMDLOG": str(logdir / f"{server}-cmds.jsonl"),
            "CONFORMANCE_START_TIMEOUT": str(start_timeout),
            "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
            "PORT": str(port),
        }
        env.pop("DEBUG", None)
        for f in files:
            with socket.socket() as sock:  # a stale server on the port would answer for the one under test
                if sock.connect_ex(("127.0.0.1", port)) == 0:
                    sys.exit(f"run.py: port {port} is already in use (a stale server?); not running {f}")
            nodeids = [n for n in (nodes or []) if n.split("::")[0].endswith("/" + f)]
            if nodes is not None and not nodeids:
                continue
            cmd = [*lock_prefix, sys.executable, "-m", "pytest", "-p", "conformance_plugin",
                   "-p", "no:cacheprovider", "-q", "-rN", f"--timeout={timeout}", *(nodeids or [f"unit/{f}"])]
            if kexpr:
                cmd += ["-k", kexpr]
            t0 = time.time()
            log = logdir / f"{server}-{f}.log"
            with open(log, "w") as lf:
                rc = subprocess.call(cmd, cwd=tests, env=env, stdout=lf, stderr=subprocess.STDOUT)
            tail = log.read_text(errors="replace").strip().splitlines()[-1:] or [""]
            print(f"[{name}] {f}: rc {rc}, {time.time() - t0:.0f} s: {tail[0][:150]}", flush=True)


# ---------------------------------------------------------------- report

PASS = "passed"


def load(path: Path) -> dict:
    return json.load(open(path)) if path.exists() else {}


def cause_key(r: dict, ref: dict | None = None) -> str:
    """A 404/405/501 that llama-server did not answer to the same request, else the first error line."""
    expected = {tuple(h) for h in (ref or {}).get("http_errors", [])}
    for method, path, status in r.get("http_errors", []):
        if status in (404, 405, 501) and (method, path, status) not in expected:
            path = re.sub(r"/slots/\d+", "/slots/{id}", path)
            return f"HTTP {status} on {method} {path}"
    err = r.get("error", "") or r.get("outcome", "")
    err = re.sub(r"0x[0-9a-f]+", "0x…", err)
    err = re.sub(r"^AssertionError: ", "", err)
    cut = min([k for k in (err.find("{"), err.find("[")) if k > 10] or [len(err)])
    return err[:cut].rstrip() + ("…" if cut < len(err) else "") if cut <= 160 else err[:160] + "…"


def report(label: str, files_filter: list[str] | None = None) -> str:
    ref = load(result_path("llama", label))
    ours = load(result_path("pydflash", label))
    ids = sorted(set(ref) | set(ours))
    if files_filter:
        ids = [i for i in ids if i.split("::")[0].split("/")[-1] in files_filter]
    per_file: dict[str, collections.Counter] = collections.OrderedDict()
    regress, notrun, fixed = [], collections.defaultdict(list), []
    for i in ids:
        f = i.split("::")[0].split("/")[-1]
        c = per_file.setdefault(f, collections.Counter())
        rl, rp = ref.get(i, {"outcome": "missing"}), ours.get(i, {"outcome": "missing"})
        c["tests"] += 1
        nr = rl["outcome"] in ("skipped", "notrunnable", "missing") or rp["outcome"] in ("notrunnable", "missing")
        if nr:
            c["not_runnable"] += 1
            src = rl if rl["outcome"] in ("skipped", "notrunnable") else rp
            reason = src.get("error") or src["outcome"]
            if rl["outcome"] == "missing" or rp["outcome"] == "missing":
                c["missing_" + ("llama" if rl["outcome"] == "missing" else "pydflash")] += 1
                reason = "not run on one server (" + ("llama-server" if rl["outcome"] == "missing" else "pydflash") + ")"
            notrun[re.sub(r"^Skipped: ", "", reason)[:200]].append(i)
            continue
        c["runnable"] += 1
        lp, pp = rl["outcome"] == PASS, rp["outcome"] == PASS
        c["llama_pass"] += lp
        c["pydflash_pass"] += pp
        c["both"] += lp and pp
        if lp and not pp:
            c["llama_only"] += 1
            regress.append((i, rp, rl))
        if pp and not lp:
            c["pydflash_only"] += 1
            fixed.append((i, rl))
    tot = collections.Counter()
    for c in per_file.values():
        tot.update(c)
    cols = ["tests", "not_runnable", "runnable", "llama_pass", "pydflash_pass", "both", "llama_only", "pydflash_only"]
    hdr = ["test file", "tests", "not runnable", "runnable", "pass llama-server", "pass pydflash",
           "pass both", "pass llama, fail pydflash", "pass pydflash only"]
    lines = [f"# Server conformance: upstream llama-server tests, label `{label}`", ""]
    meta = {}
    for s in ("llama", "pydflash"):
        mp = result_path(s, label).with_suffix(".meta.json")
        if mp.exists():
            meta[s] = json.load(open(mp))
    for s, m in meta.items():
        lines.append(f"- {SERVERS[s][0]}: run {m.get('date')} at pydflash commit `{m.get('commit')}`"
                     + (f"; only the tests that passed on llama-server and failed in `{m['rerun_failing_of']}` were "
                        f"re-run, the others keep their `{m['rerun_failing_of']}` outcome"
                        if m.get("rerun_failing_of") else ""))
    ratio = (tot["both"] / tot["llama_pass"]) if tot["llama_pass"] else 0.0
    lines += ["", f"**pydflash passes {tot['both']} of the {tot['llama_pass']} runnable tests llama-server passes "
              f"({100 * ratio:.1f} %)**; {tot['llama_only']} pass on llama-server and fail on pydflash.", "",
              "| " + " | ".join(hdr) + " |", "|" + "---|" * len(hdr)]
    for f, c in per_file.items():
        pend = [n for n in ("llama", "pydflash") if c["missing_" + n]]
        note = f" (not run on {', '.join(SERVERS[n][0] for n in pend)})" if pend else ""
        lines.append(f"| {f}{note} | " + " | ".join(str(c[k]) for k in cols) + " |")
    lines.append("| **total** | " + " | ".join(f"**{tot[k]}**" for k in cols) + " |")

    groups = collections.defaultdict(list)
    for i, rp, rl in regress:
        groups[cause_key(rp, rl)].append((i, rp))
    lines += ["", f"## Pass on llama-server, fail on pydflash ({len(regress)}), grouped by first failure", ""]
    for key, items in sorted(groups.items(), key=lambda kv: (-len(kv[1]), kv[0])):
        lines.append(f"### {len(items)} × `{key}`")
        for i, rp in items:
            where = rp.get("where") or ""
            err = rp.get("error", "")
            extra = f" — `{where}`" if where else ""
            if err and err[:160] != key:
                extra += f" — {err[:200]}"
            lines.append(f"- `{i}`{extra}")
        lines.append("")
    if fixed:
        lines += [f"## Pass on pydflash, fail on llama-server ({len(fixed)})", ""]
        for i, rl in fixed:
            lines.append(f"- `{i}` — llama-server: {rl.get('error', '')[:200]}")
        lines.append("")
    lines += [f"## Not runnable here ({sum(len(v) for v in notrun.values())}), by reason", ""]
    for reason, items in sorted(notrun.items(), key=lambda kv: (-len(kv[1]), kv[0])):
        fs = collections.Counter(i.split("::")[0].split("/")[-1] for i in items)
        lines.append(f"- {len(items)} × {reason} — " + ", ".join(f"{k} ({v})" for k, v in sorted(fs.items())))
    return "\n".join(lines) + "\n"


def all_files() -> list[str]:
    return sorted(p.name for p in (UPSTREAM / "tools/server/tests/unit").glob("test_*.py"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("files", nargs="*", help="test files (test_x.py) to run; default all")
    ap.add_argument("--server", choices=["llama", "pydflash", "both"], default="both")
    ap.add_argument("--label", default="before", help="names pydflash-<label>.json and report-<label>.md")
    ap.add_argument("-k", dest="kexpr", default=None, help="pytest -k expression")
    ap.add_argument("--fresh", action="store_true", help="drop the server's previous results first")
    ap.add_argument("--timeout", type=int, default=180, help="per-test timeout in s (pytest-timeout)")
    ap.add_argument("--start-timeout", type=int, default=240, help="server start timeout in s")
    ap.add_argument("--rerun-failing", metavar="FROM_LABEL", default=None,
                    help="pydflash only: start from pydflash-FROM_LABEL.json and re-run just the tests that pass "
                         "on llama-server and fail there (a quick 'after'; tests that passed are not re-checked)")
    ap.add_argument("--skip-done", action="store_true",
                    help="per server, skip test files that already have results (resume a run)")
    ap.add_argument("--report-only", action="store_true", help="only rebuild report-<label>.md")
    ap.add_argument("--logdir", default=None, help="pytest logs (default a temp dir)")
    a = ap.parse_args()
    files = [Path(f).name for f in a.files] or all_files()
    servers = ["llama", "pydflash"] if a.server == "both" else [a.server]
    if a.rerun_failing:
        servers = ["pydflash"]
    if not a.report_only:
        logdir = Path(a.logdir or tempfile.mkdtemp(prefix="conformance-logs-"))
        logdir.mkdir(parents=True, exist_ok=True)
        print(f"logs: {logdir}", flush=True)
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                                text=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "pydflash", "native"], cwd=REPO,
                               capture_output=True, text=True).stdout.strip()
        for s in servers:
            if a.skip_done and result_path(s, a.label).with_suffix(".meta.json").exists():
                continue
            if a.fresh and result_path(s, a.label).exists():
                result_path(s, a.label).unlink()
            meta = {"date": datetime.datetime.now().isoformat(timespec="minutes"),
                    "commit": commit + ("+dirty" if dirty else "")}
            if a.rerun_failing:
                meta["rerun_failing_of"] = a.rerun_failing
            result_path(s, a.label).with_suffix(".meta.json").parent.mkdir(parents=True, exist_ok=True)
            result_path(s, a.label).with_suffix(".meta.json").write_text(json.dumps(meta) + "\n")
        nodes = None
        if a.rerun_failing:
            ref, prev = load(result_path("llama", a.label)), load(result_path("pydflash", a.rerun_failing))
            nodes = [i for i, r in ref.items() if r["outcome"] == PASS and prev.get(i, {}).get("outcome") != PASS
                     and prev.get(i, {}).get("outcome") != "notrunnable"]
            result_path("pydflash", a.label).write_text(json.dumps(prev, indent=1, sort_keys=True))
            print(f"re-running {len(nodes)} tests", flush=True)
        for f in files:  # interleaved per file: partial results are comparable early
            todo = [s for s in servers if not (a.skip_done and any(
                i.split("::")[0].endswith("/" + f) for i in load(result_path(s, a.label))))]
            if not todo:
                continue
            # one hold of /tmp/cpu.lock (flock(2), as flock(1) takes it) for the file on every server
            with open("/tmp/cpu.lock", "a") as lockf:
                fcntl.flock(lockf, fcntl.LOCK_EX)
                try:
                    for s in todo:
                        run_server(s, a.label, [f], a.kexpr, a.timeout, a.start_timeout, logdir, nodes,
                                   lock_prefix=())
                finally:
                    fcntl.flock(lockf, fcntl.LOCK_UN)
            (RESULTS / f"report-{a.label}.md").write_text(report(a.label))
    text = report(a.label)
    (RESULTS / f"report-{a.label}.md").write_text(text)
    print(text.split("## Pass on llama-server")[0])
    return 0


if __name__ == "__main__":
    sys.exit(main())
