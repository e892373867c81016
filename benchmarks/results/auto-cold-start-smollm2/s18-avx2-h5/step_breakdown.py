"""Session 18's per-step breakdown of the main command: plain / history / drafter steps, their
committed tokens and times, one fresh process per (prompt, mode), modes rotated per prompt.

    python step_breakdown.py OUT.jsonl N_PROMPTS auto,history,plain [DRAFTER]

(auto: the defaults with DRAFTER, default the shipped one; history: no drafter, lookup 2; plain)
"""
import collections
import json
import os
import statistics
import subprocess
import sys


def one(mode: str, index: int, drafter: str) -> None:
    os.environ["PYDFLASH_AUTOTUNE_CACHE"] = "0"  # cold, as auto_cold_start.py's *-cold modes
    from pydflash import Engine
    from pydflash.fetch import prompt_sets as prompts
    from pydflash.runtime.generation import SamplingOptions

    prompt = prompts.load("humaneval", limit=1, offset=132 + index)[0]
    with Engine("smollm2-135m", drafter if mode == "auto" else None, n_ctx=4096, n_threads=2,
                n_max=0 if mode == "plain" else "auto", lookup=0 if mode == "plain" else 2) as e:
        toks = e.target.tokenize(prompt.render(e.target))
        sched = e._sched()
        sid = sched.add(toks, SamplingOptions.build(max_tokens=128, temperature=0, ignore_eos=True), slot=0,
                        cache_prompt=False)
        steps = []
        while sid not in sched.finished():
            i = sched.step()
            if i.n_prefill_rows or not i.n_decoding:
                continue
            kind = "plain" if i.n_rows == 1 else ("draft" if i.t_draft_ms > 0 else "hist")
            steps.append((kind, i.n_rows, i.n_committed, i.t_draft_ms, i.t_verify_ms, i.t_step_ms))
        r = sched.take(sid)
        print(json.dumps({"mode": mode, "prompt": prompt.id, "tok_s": r.stats.tokens_per_second, "steps": steps}))


def main() -> None:
    if sys.argv[1] == "--one":
        one(sys.argv[2], int(sys.argv[3]), sys.argv[4])
        return
    out, n, modes = sys.argv[1], int(sys.argv[2]), sys.argv[3].split(",")
    drafter = sys.argv[4] if len(sys.argv) > 4 else "auto"
    rows = []
    with open(out, "a") as f:
        for i in range(n):
            for m in modes[i % len(modes):] + modes[: i % len(modes)]:
                p = subprocess.run([sys.executable, os.path.abspath(__file__), "--one", m, str(i), drafter],
                                   capture_output=True, text=True, cwd="/tmp")
                line = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
                if line:
                    rows.append(json.loads(line[0]))
                    f.write(line[0] + "\n")
    for m in modes:
        rs = [r for r in rows if r["mode"] == m]
        agg = collections.defaultdict(lambda: [0, 0, 0.0, 0.0, 0.0])
        for r in rs:
            for kind, _, nc, td, tv, ts in r["steps"]:
                a = agg[kind]
                a[0], a[1], a[2], a[3], a[4] = a[0] + 1, a[1] + nc, a[2] + ts, a[3] + td, a[4] + tv
        tot_t, tot_c = sum(a[2] for a in agg.values()), sum(a[1] for a in agg.values())
        print(f"== {m}: {len(rs)} prompts, {tot_c} tokens in {tot_t:.0f} ms = {1000 * tot_c / tot_t:.1f} tok/s, "
              f"median per prompt {statistics.median(r['tok_s'] for r in rs):.1f}")
        for kind, (cnt, nc, ts, td, tv) in sorted(agg.items()):
            print(f"  {kind:6s} steps {cnt:5d} committed {nc:5d} ({nc / cnt:.2f}/step) step {ts / cnt:6.2f} ms "
                  f"draft {td / cnt:5.2f} verify {tv / cnt:6.2f}")


if __name__ == "__main__":
    main()
