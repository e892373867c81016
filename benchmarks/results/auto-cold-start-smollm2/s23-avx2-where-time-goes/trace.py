"""Per-step trace of one generation, defaults (shipped drafter, auto) vs the history alone, each in a
fresh process: python trace.py IDX,IDX REPEATS OUT.json (HumanEval 132 + IDX, up to 128 tokens, greedy)."""
import json, sys

def worker(mode, idx):
    from pydflash import Engine
    from pydflash.runtime.generation import SamplingOptions
    from pydflash.fetch import prompt_sets as prompts
    p = prompts.load("humaneval", limit=1, offset=132 + idx)[0]
    drafter = None if mode == "history" else "auto"
    with Engine("smollm2-135m", drafter, n_threads=2, n_max="auto", lookup=2) as e:
        sched = e.scheduler
        toks = e.target.tokenize(p.render(e.target), parse_special=True)
        opts = SamplingOptions.build(max_tokens=128, temperature=0.0, seed=0, top_k=0, top_p=1.0, min_p=0.0)
        sid = sched.add(toks, opts, cache_prompt=False)
        steps = []
        while True:
            info = sched.step()
            steps.append(dict(w=info.width, rows=info.n_rows, pre=info.n_prefill_rows, c=info.n_committed,
                              dr=info.n_drafting, td=info.t_draft_ms, tv=info.t_verify_ms, ts=info.t_step_ms, pr=info.probe))
            if sched.finished():
                break
        print(json.dumps(dict(mode=mode, idx=idx, steps=steps)))

if __name__ == "__main__":
    if sys.argv[1] == "w":
        worker(sys.argv[2], int(sys.argv[3])); sys.exit()
    from diag import alternate  # the same runner, this folder's diag.py
    alternate(__file__, [int(x) for x in sys.argv[1].split(",")], int(sys.argv[2]), sys.argv[3], echo=False)
