"""Per-prompt time split, defaults vs the history alone (one fresh process per run, the two modes
alternated per prompt): python diag.py N_PROMPTS REPEATS OUT.json (HumanEval 132.., 128 tokens, greedy)."""
import json, subprocess, sys

def worker(mode, idx):
    from pydflash import Engine
    from pydflash.fetch import prompt_sets as prompts
    p = prompts.load("humaneval", limit=1, offset=132 + idx)[0]
    drafter = None if mode == "history" else "auto"
    with Engine("smollm2-135m", drafter, n_threads=2, n_max="auto", lookup=2) as e:
        r = e.generate(p.render(e.target), max_tokens=128, temperature=0, ignore_eos=True)
        s = r.stats
        print(json.dumps(dict(mode=mode, idx=idx, tok_s=s.tokens_per_second, steps=s.n_verify_steps,
              drafted=s.n_drafted, acc=s.n_accepted, ld=s.n_lookup_drafted, la=s.n_lookup_accepted,
              trimmed=s.n_trimmed, t_draft=s.t_draft_ms, t_verify=s.t_verify_ms, t_accept=s.t_accept_ms,
              t_total=s.t_total_ms, widths=e.last_widths)))

def alternate(script, idxs, reps, out_path, echo=True):
    """Run ``script w MODE IDX`` in a fresh process per (prompt, mode), the two modes alternated per
    prompt and round; the JSON line each prints, collected into out_path."""
    rows = []
    for rep in range(reps):
        for i in idxs:
            for m in (["auto", "history"] if (i + rep) % 2 == 0 else ["history", "auto"]):
                out = subprocess.run([sys.executable, script, "w", m, str(i)], capture_output=True, text=True, cwd="/tmp")
                line = [l for l in out.stdout.splitlines() if l.startswith("{")]
                if not line:
                    print(out.stderr[-2000:]); continue
                d = json.loads(line[-1]); d["rep"] = rep; rows.append(d)
                if echo:
                    print(json.dumps(d), flush=True)
    json.dump(rows, open(out_path, "w"))


if __name__ == "__main__":
    if sys.argv[1] == "w":
        worker(sys.argv[2], int(sys.argv[3])); sys.exit()
    alternate(__file__, range(int(sys.argv[1])), int(sys.argv[2]), sys.argv[3])
