"""Per-step trace, defaults (shipped drafter, auto) vs the history alone, SmolLM2, HumanEval 132..163,
128 greedy tokens: which source drafted each step (td > 0: the drafter's block ran) and its width."""
import json, subprocess, sys

def worker(mode, idx):
    from pydflash import Engine
    from pydflash.runtime.generation import SamplingOptions
    from pydflash.fetch import prompt_sets as prompts
    p = prompts.load("humaneval", limit=1, offset=132 + idx)[0]
    with Engine("smollm2-135m", None if mode == "history" else "auto", n_threads=2, n_max="auto", lookup=2) as e:
        sched = e.scheduler
        toks = e.target.tokenize(p.render(e.target), parse_special=True)
        opts = SamplingOptions.build(max_tokens=128, temperature=0.0, seed=0, top_k=0, top_p=1.0, min_p=0.0)
        sched.add(toks, opts, cache_prompt=False)
        steps = []
        while True:
            i = sched.step()
            steps.append(dict(w=i.width, rows=i.n_rows, pre=i.n_prefill_rows, c=i.n_committed, td=round(i.t_draft_ms, 3),
                              tv=round(i.t_verify_ms, 3), pr=i.probe))
            if sched.finished():
                break
        print(json.dumps(dict(mode=mode, idx=idx, steps=steps, tuning=sched.tuning())))

if __name__ == "__main__":
    if sys.argv[1] == "w":
        worker(sys.argv[2], int(sys.argv[3])); sys.exit()
    out = open(sys.argv[2], "w")
    for idx in range(int(sys.argv[1])):
        for mode in (("auto", "history") if idx % 2 == 0 else ("history", "auto")):
            r = subprocess.run([sys.executable, __file__, "w", mode, str(idx)], capture_output=True, text=True)
            line = [l for l in r.stdout.splitlines() if l.startswith("{")]
            out.write(line[-1] + "\n" if line else json.dumps(dict(mode=mode, idx=idx, err=r.stderr[-500:])) + "\n"); out.flush()
