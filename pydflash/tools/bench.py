"""``pydflash bench``: plain vs speculative decoding, ours and upstream's, in one interleaved run.

Modes (each prompt runs every mode before the next prompt, in a rotating order, so a noisy spell
on a shared machine hits all modes alike):

- ``plain``: our target alone (the reference every speedup is relative to);
- ``dflash-n<k>``: our engine with the DFlash drafter and a fixed n_max = k;
- ``dflash[<file>]-n<k>``: the same with each ``--also-draft`` drafter (e.g. reduced vocabulary);
- ``dflash-auto``: our engine choosing n_max itself (``pydflash.tools.autotune``; 0 = speculation off);
- ``upstream-plain``: the shipped llama-server on the same target;
- ``upstream-dflash-n<k>``: the shipped llama-server, ``--spec-type draft-dflash`` with the same
  drafter file;
- ``upstream-simple-n<k>``: the shipped llama-server, ``--spec-type draft-simple`` with a small
  model of the same tokenizer drafting (e.g. Qwen2.5-Coder-0.5B for the 1.5B).

Speed is decode speed (tokens after the prompt / decode time), which both engines report the same
way. A mode that fails (e.g. upstream DFlash on a target whose graph cannot expose layer inputs)
is reported as failed with its reason; the others go on.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

from .. import __version__
from ..runtime import devices
from ..fetch import registry as models, prompt_sets as prompts
from .upstream_server import UpstreamServer, peak_rss_mib
from ..runtime.engine import Engine

__all__ = ["Sample", "run_bench", "main"]


@dataclass
class Sample:
    """One prompt generated in one mode."""

    mode: str
    prompt_id: str
    category: str
    n_tokens: int
    decode_s: float
    prefill_s: float
    n_steps: int = 0
    n_drafted: int = 0
    n_accepted: int = 0
    n_max: int | None = None
    accepted_per_position: list[int] = field(default_factory=list)
    t_draft_s: float = 0.0
    t_verify_s: float = 0.0
    tokens: list[int] = field(default_factory=list, repr=False)

    @property
    def tokens_per_second(self) -> float:
        return self.n_tokens / self.decode_s if self.decode_s > 0 else 0.0


def _ours(mode: str, prompt: prompts.Prompt, result, n_max: int | None) -> Sample:  # type: ignore[no-untyped-def]
    s = result.stats
    return Sample(mode=mode, prompt_id=prompt.id, category=prompt.category, n_tokens=s.n_generated,
                  decode_s=(s.t_total_ms - s.t_prefill_ms) / 1000.0, prefill_s=s.t_prefill_ms / 1000.0,
                  n_steps=s.n_verify_steps, n_drafted=s.n_drafted, n_accepted=s.n_accepted, n_max=n_max,
                  accepted_per_position=list(s.accepted_per_position), t_draft_s=s.t_draft_ms / 1000.0,
                  t_verify_s=s.t_verify_ms / 1000.0, tokens=list(result.tokens))


def _upstream(mode: str, prompt: prompts.Prompt, out: dict) -> Sample:
    t = out.get("timings", {})
    n = int(t.get("predicted_n", 0))
    drafted, accepted = int(t.get("draft_n", 0) or 0), int(t.get("draft_n_accepted", 0) or 0)
    return Sample(mode=mode, prompt_id=prompt.id, category=prompt.category, n_tokens=n,
                  decode_s=float(t.get("predicted_ms", 0.0)) / 1000.0, prefill_s=float(t.get("prompt_ms", 0.0)) / 1000.0,
                  n_steps=max(n - accepted, 0) if drafted else n, n_drafted=drafted, n_accepted=accepted,
                  tokens=[int(x) for x in out.get("tokens", [])])


@dataclass
class Mode:
    name: str
    run: Callable[[prompts.Prompt, str], Sample]
    close: Callable[[], None] = lambda: None
    peak_rss: Callable[[], float] = lambda: 0.0
    error: str = ""


def _server_mode(name: str, args: list[str], sampling: dict, n_predict: int) -> Mode:
    server = UpstreamServer(args)

    def run(prompt: prompts.Prompt, text: str) -> Sample:
        if server.proc.poll() is not None:
            raise RuntimeError(f"llama-server exited with {server.proc.returncode}:\n{server.log_tail()}")
        return _upstream(name, prompt, server.complete(text, n_predict, **sampling))

    return Mode(name, run, close=server.close, peak_rss=lambda: server.peak_rss_mib)


def run_bench(args: argparse.Namespace, log: Callable[[str], None] = print) -> dict:
    """Run every mode on every prompt (interleaved); return the report dict."""
    prompt_list = prompts.load(args.prompts, limit=args.limit, offset=args.offset)
    target_path = models.resolve(args.model)
    drafter_path = Path(args.model_draft) if args.model_draft else None
    n_max_list = [] if drafter_path is None else [int(k) for k in args.n_max.split(",") if k.strip()]
    sampling = {"temperature": args.temp, "seed": args.seed, "ignore_eos": args.ignore_eos}
    upstream_sampling = {"temperature": args.temp, "seed": args.seed, "ignore_eos": args.ignore_eos,
                         "top_k": 0 if args.temp > 0 else 40, "top_p": 1.0, "min_p": 0.0}
    common = ["-m", str(target_path), "-t", str(args.threads), "-tb", str(args.threads), "-c", str(args.ctx_size),
              "-np", "1", "--fit", "off", "--no-warmup", "-ngl", str(args.n_gpu_layers)]
    if args.rpc:
        common += ["--rpc", args.rpc]
    spec_common = ["-ngld", str(args.n_gpu_layers), "-td", str(args.threads)]  # upstream drafters sit with the target
    devices.add_rpc_servers(args.rpc)
    placement = dict(n_gpu_layers=args.n_gpu_layers, drafter_device=args.device_draft)

    engine = Engine(target_path, drafter_path, n_ctx=args.ctx_size, n_threads=args.threads,
                    n_max="auto" if args.auto else None, **placement)  # costs are measured only for the auto mode
    modes: list[Mode] = []
    failed: dict[str, str] = {}

    def add(name: str, make: Callable[[], Mode]) -> None:
        try:
            modes.append(make())
        except Exception as exc:  # a mode that cannot start is reported, the others go on
            failed[name] = _first_lines(str(exc))
            log(f"[bench] {name}: failed to start: {failed[name]}")

    def ours(name: str, n_max: int | None, eng: Engine = engine) -> Mode:
        def run(prompt: prompts.Prompt, text: str) -> Sample:
            if name == "plain":
                return _ours(name, prompt, eng.target.generate(text, max_tokens=args.max_tokens, **sampling), 0)
            result = eng.generate(text, n_max=n_max, max_tokens=args.max_tokens, **sampling)
            return _ours(name, prompt, result, eng.last_n_max)

        return Mode(name, run)

    add("plain", lambda: ours("plain", 0))
    for k in n_max_list:
        add(f"dflash-n{k}", lambda k=k: ours(f"dflash-n{k}", k))
    extra_engines: list[Engine] = []
    for path in getattr(args, "also_draft", None) or []:  # other drafters (e.g. a reduced-vocabulary one)
        try:
            extra_engines.append(Engine(target_path, path, n_ctx=args.ctx_size, n_threads=args.threads, n_max=None,
                                        **placement))
        except Exception as exc:
            failed[f"dflash[{Path(path).stem}]"] = _first_lines(str(exc))
            continue
        for k in n_max_list:
            name = f"dflash[{Path(path).stem}]-n{k}"
            add(name, lambda k=k, name=name, eng=extra_engines[-1]: ours(name, k, eng))
    if drafter_path is not None and args.auto:
        add("dflash-auto", lambda: ours("dflash-auto", None))
    if args.upstream:
        add("upstream-plain", lambda: _server_mode("upstream-plain", common, upstream_sampling, args.max_tokens))
        for k in n_max_list:
            name = f"upstream-dflash-n{k}"
            add(name, lambda k=k, name=name: _server_mode(
                name, [*common, "-md", str(drafter_path), "--spec-type", "draft-dflash", "--spec-draft-n-max", str(k),
                       "--spec-draft-n-min", "0", *spec_common], upstream_sampling, args.max_tokens))
    if args.draft_simple:
        simple_path = models.resolve(args.draft_simple)
        for k in [int(x) for x in args.simple_n_max.split(",") if x.strip()]:
            name = f"upstream-simple-n{k}"
            add(name, lambda k=k, name=name: _server_mode(
                name, [*common, "-md", str(simple_path), "--spec-type", "draft-simple", "--spec-draft-n-max", str(k),
                       "--spec-draft-n-min", "0", *spec_common],
                upstream_sampling, args.max_tokens))

    samples: list[Sample] = []
    t0 = time.perf_counter()
    try:
        rendered = [p.render(engine.target) for p in prompt_list]
        for m in modes:  # warm up every mode once (first-call allocations, page faults)
            if not m.error:
                try:
                    m.run(prompt_list[0], rendered[0][:200])
                except Exception as exc:
                    m.error = _first_lines(str(exc))
                    log(f"[bench] {m.name}: failed: {m.error}")
        for i, (prompt, text) in enumerate(zip(prompt_list, rendered)):
            order = modes[i % len(modes):] + modes[: i % len(modes)]
            for m in order:
                if m.error:
                    continue
                try:
                    sample = m.run(prompt, text)
                except Exception as exc:
                    m.error = _first_lines(str(exc))
                    log(f"[bench] {m.name}: failed on {prompt.id}: {m.error}")
                    continue
                samples.append(sample)
                log(f"[bench] {prompt.id:<24} {m.name:<22} {sample.n_tokens:4d} tok {sample.tokens_per_second:7.1f} tok/s"
                    + (f"  n_max {sample.n_max}" if sample.n_max else ""))
        costs = _learned_costs(engine.tuning())
        if costs:
            log(f"[bench] costs the auto scheduler measured: {_costs_line(costs)}")
        ours_rss = peak_rss_mib()
    finally:
        for m in modes:
            m.close()
        for eng in [engine, *extra_engines]:
            eng.close()
    for m in modes:
        if m.error:
            failed[m.name] = m.error
    summary = summarize(samples, [m.name for m in modes])
    for m in modes:
        if m.name in summary:
            summary[m.name]["peak_rss_mib"] = round(m.peak_rss() or ours_rss, 1)
    return {
        **report_header(args, "bench", t0),
        "costs": costs,
        "summary": summary,
        "failed": failed,
        "samples": [{k: v for k, v in asdict(s).items() if k != "tokens"} for s in samples],
    }


def summarize(samples: list[Sample], mode_names: list[str]) -> dict[str, dict]:
    """Per mode: median and total tokens/s, speedup vs ``plain`` (median of per-prompt ratios),
    tau, acceptance, acceptance per position, draft/verify shares, agreement with plain."""
    plain = {s.prompt_id: s for s in samples if s.mode == "plain"}
    out: dict[str, dict] = {}
    for name in mode_names:
        rows = [s for s in samples if s.mode == name]
        if not rows:
            continue
        tokens, decode = sum(s.n_tokens for s in rows), sum(s.decode_s for s in rows)
        ratios = [s.tokens_per_second / plain[s.prompt_id].tokens_per_second for s in rows
                  if s.prompt_id in plain and plain[s.prompt_id].tokens_per_second > 0]
        steps = sum(s.n_steps for s in rows)
        entry = {
            "prompts": len(rows),
            "tokens": tokens,
            "tok_s_median": round(statistics.median(s.tokens_per_second for s in rows), 2),
            "tok_s_total": round(tokens / decode, 2) if decode > 0 else 0.0,
            "speedup_vs_plain": round(statistics.median(ratios), 3) if ratios else None,
            "tau": round(tokens / steps, 3) if steps and any(s.n_drafted for s in rows) else None,
            "drafted": sum(s.n_drafted for s in rows),
            "accepted": sum(s.n_accepted for s in rows),
        }
        entry["acceptance_rate"] = round(entry["accepted"] / entry["drafted"], 3) if entry["drafted"] else None
        per_pos = [sum(s.accepted_per_position[j] for s in rows if len(s.accepted_per_position) > j) for j in range(16)]
        if any(per_pos) and steps:
            last = max(j for j, v in enumerate(per_pos) if v) + 1
            entry["accepted_per_position"] = [round(v / steps, 3) for v in per_pos[:last]]
        if any(s.t_draft_s for s in rows):  # shares of a speculative cycle (ours only)
            entry["draft_share"] = round(sum(s.t_draft_s for s in rows) / decode, 3)
            entry["verify_share"] = round(sum(s.t_verify_s for s in rows) / decode, 3)
            entry["other_share"] = round(1 - entry["draft_share"] - entry["verify_share"], 3)
        n_max_used = [s.n_max for s in rows if s.n_max is not None]
        if name == "dflash-auto" and n_max_used:
            entry["n_max_chosen"] = n_max_used
        same = [s.tokens == plain[s.prompt_id].tokens for s in rows if s.prompt_id in plain and s.tokens]
        if same and name != "plain":
            entry["same_tokens_as_plain"] = f"{sum(same)}/{len(same)}"
        out[name] = entry
    return out


def report_header(args: argparse.Namespace, command: str, t0: float) -> dict:
    """What every report (bench, profile) starts with: the command, its config, the machine, the wall time."""
    return {
        "command": "pydflash " + " ".join(getattr(args, "argv", [command])),
        "config": {k: v for k, v in vars(args).items() if k not in ("func", "argv")},
        "machine": machine_info(args.threads),
        "wall_s": round(time.perf_counter() - t0, 1),
    }


def machine_info(threads: int) -> dict:
    cpu = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "threads": threads, "machine": platform.machine(),
            "python": platform.python_version(), "pydflash": __version__, "llama_cpp": "llama-cpp-python 0.3.36 (vendor)"}


def _learned_costs(tuning: dict | None) -> dict | None:
    """The auto scheduler's measured costs in units of one plain step: c_verify(r) for the row
    counts it ran, c_draft(k) for the widths it drafted (0 = never measured)."""
    if not tuning or tuning["t_rows_ms"][0] <= 0:
        return None
    t1 = tuning["t_rows_ms"][0]
    known = [i for i, t in enumerate(tuning["t_rows_ms"]) if t > 0]
    verify = [t / t1 for t in tuning["t_rows_ms"][: known[-1] + 1]]
    drafted = [i for i, t in enumerate(tuning["t_draft_ms"]) if t > 0]
    draft = [t / t1 for t in tuning["t_draft_ms"][: drafted[-1] + 1]] if drafted else []
    return {"t_step_ms": t1, "verify": verify, "draft": draft}


def _costs_line(costs: dict) -> str:
    v = ", ".join(f"{x:.2f}" for x in costs["verify"])
    d = ", ".join(f"{x:.2f}" for x in costs["draft"])
    return f"plain step {costs['t_step_ms']:.2f} ms; c_verify(1..) = {v}; c_draft(1..) = {d} (in plain steps, 0 = not run)"


def _first_lines(text: str, n: int = 3) -> str:
    """A short reason: the first line, plus the log's first error/assert lines when there are any."""
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    errors = [ln for ln in lines[1:] if any(w in ln for w in ("error", "ERROR", "ASSERT", "failed", "abort"))]
    return " | ".join((lines[:1] + errors[:n - 1]) if errors else lines[:n])[:400]


# -- reports -------------------------------------------------------------------------------------

_COLUMNS = [("tok_s_median", "tok/s (median)"), ("tok_s_total", "tok/s (total)"), ("speedup_vs_plain", "speedup"),
            ("tau", "τ"), ("acceptance_rate", "accept"), ("draft_share", "draft"), ("verify_share", "verify"),
            ("other_share", "other"), ("peak_rss_mib", "peak RSS MiB"), ("same_tokens_as_plain", "= plain")]


def markdown(report: dict) -> str:
    """The report as a Markdown page: command, machine, the table, per-position acceptance."""
    cfg, summary = report["config"], report["summary"]
    lines = [f"# pydflash bench: {Path(str(cfg['model'])).name}", "",
             f"Command: `{report['command']}`", "",
             f"Machine: {report['machine']['cpu']}, {report['machine']['cores']} cores, "
             f"{report['machine']['threads']} threads; pydflash {report['machine']['pydflash']}; wall {report['wall_s']} s.",
             f"Prompts: {cfg['prompts']} (limit {cfg['limit']}, offset {cfg['offset']}), max_tokens {cfg['max_tokens']}, "
             f"temperature {cfg['temp']}, drafter {cfg.get('model_draft')}.", "",
             "| mode | " + " | ".join(title for _, title in _COLUMNS) + " |",
             "|---|" + "---|" * len(_COLUMNS)]
    for name, entry in summary.items():
        cells = ["" if entry.get(key) is None else str(entry.get(key)) for key, _ in _COLUMNS]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    if report.get("failed"):
        lines += ["", "Failed modes:"] + [f"- `{k}`: {v}" for k, v in report["failed"].items()]
    per_pos = {k: v["accepted_per_position"] for k, v in summary.items() if v.get("accepted_per_position")}
    if per_pos:
        lines += ["", "Accepted drafts per verify step, by draft position (fraction of steps reaching it):", ""]
        lines += [f"- {k}: {v}" for k, v in per_pos.items()]
    if report.get("costs"):
        c = report["costs"]
        lines += ["", f"Measured costs (units of one plain step = {c['t_step_ms']:.2f} ms): "
                      f"c_verify(1..{len(c['verify'])}) = {[round(x, 2) for x in c['verify']]}, "
                      f"c_draft(1..{len(c['draft'])}) = {[round(x, 2) for x in c['draft']]}."]
    auto = summary.get("dflash-auto", {}).get("n_max_chosen")
    if auto:
        lines += [f"dflash-auto chose n_max per prompt: {auto}."]
    return "\n".join(lines) + "\n"


def pyplot():  # type: ignore[no-untyped-def]
    """(matplotlib.pyplot, MaxNLocator) on the file-only Agg backend, or None without matplotlib
    (the ``bench`` extra): reports are still written, only the PNG is skipped."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import MaxNLocator
    except ImportError:
        return None
    return plt, MaxNLocator


def plot(report: dict, path: Path) -> bool:
    """tokens/s per mode and acceptance per position, as a PNG; False without matplotlib."""
    if (mpl := pyplot()) is None:
        return False
    plt, MaxNLocator = mpl
    summary = report["summary"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    names = list(summary)
    ax1.barh(names, [summary[n]["tok_s_median"] for n in names], color="tab:blue")
    ax1.set_xlabel("tokens/s (median over prompts)")
    ax1.invert_yaxis()
    for n in names:
        if summary[n].get("accepted_per_position"):
            v = summary[n]["accepted_per_position"]
            ax2.plot(range(1, len(v) + 1), v, marker="o", label=n)
    ax2.set_xlabel("draft position")
    ax2.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax2.set_ylabel("fraction of verify steps accepting it")
    ax2.set_ylim(0, 1)
    if ax2.lines:
        ax2.legend(fontsize=8)
    fig.suptitle(f"pydflash bench: {Path(str(report['config']['model'])).name}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def write_report(report: dict, out_dir: Path, stem: str = "bench") -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / f"{stem}.json", out_dir / f"{stem}.md"]
    paths[0].write_text(json.dumps(report, indent=2) + "\n")
    paths[1].write_text(markdown(report))
    if plot(report, out_dir / f"{stem}.png"):
        paths.append(out_dir / f"{stem}.png")
    return paths


# -- command line --------------------------------------------------------------------------------

def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("-m", "--model", default=None, help="target GGUF path or `pydflash models` name (or -hf)")
    p.add_argument("-md", "--model-draft", default=None, help="DFlash drafter GGUF (omit: plain modes only)")
    p.add_argument("--also-draft", action="append", default=[], metavar="GGUF",
                   help="another drafter to run at the same n_max values (repeatable), e.g. a reduced-vocabulary one")
    p.add_argument("--draft-simple", default=None,
                   help="small model of the same tokenizer for upstream draft-simple (e.g. qwen2.5-coder-0.5b)")
    p.add_argument("--prompts", default="humaneval", help="humaneval, gsm_symbolic, a .jsonl file, or a comma list")
    p.add_argument("--limit", type=int, default=8, help="prompts per source (default 8)")
    p.add_argument("--offset", type=int, default=0, help="skip this many prompts of each source")
    p.add_argument("-n", "--max-tokens", type=int, default=64)
    p.add_argument("--n-max", default="1,3,7", help="fixed n_max values to run (comma list; default 1,3,7)")
    p.add_argument("--simple-n-max", default="4", help="n_max values for upstream draft-simple (default 4)")
    p.add_argument("--no-auto", dest="auto", action="store_false", help="skip the dflash-auto mode")
    p.add_argument("--no-upstream", dest="upstream", action="store_false", help="skip the llama-server modes")
    p.add_argument("-t", "--threads", type=int, default=min(os.cpu_count() or 1, 4))
    p.add_argument("-c", "--ctx-size", type=int, default=2048)
    devices.add_arguments(p)
    p.add_argument("--temp", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ignore-eos", action="store_true", help="always generate max_tokens")
    p.add_argument("-o", "--out", default="bench-results", help="directory for bench.json / .md / .png")


def validate(args: argparse.Namespace) -> str | None:
    """A message for arguments that cannot work, else None."""
    if args.limit < 1 or args.max_tokens < 1 or args.threads < 1 or args.ctx_size < 64:
        return "--limit, --max-tokens and --threads must be >= 1 and --ctx-size >= 64"
    try:
        ks = [int(k) for k in args.n_max.split(",") if k.strip()] + [int(k) for k in args.simple_n_max.split(",") if k.strip()]
    except ValueError:
        return "--n-max and --simple-n-max take comma-separated integers"
    if any(k < 1 for k in ks):
        return "--n-max / --simple-n-max values must be >= 1"
    for path in [args.model_draft, *args.also_draft]:
        if path and not Path(path).is_file():
            return f"drafter not found: {path}"
    if args.also_draft and not args.model_draft:
        return "--also-draft needs -md"
    if args.temp < 0:
        return "--temp must be >= 0"
    return None


def main(args: argparse.Namespace) -> int:
    problem = validate(args)
    if problem:
        print(f"pydflash bench: {problem}", file=sys.stderr)
        return 2
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    report = run_bench(args, log=log)
    paths = write_report(report, Path(args.out))
    print(markdown(report))
    log("[bench] wrote " + ", ".join(str(p) for p in paths))
    return 0
